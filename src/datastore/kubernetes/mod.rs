//! The Kubernetes datastore (KDD): Calico's objects as custom resources, workload endpoints
//! as the pods themselves (libcalico-go `backend/k8s`). Keys map to REST paths; values are
//! converted to and from the CRs (`crd`), pods (`pods`) and core Nodes.
//!
//! CAS is the resourceVersion: a PUT with a stale one is a 409 Conflict, and a delete at a
//! revision is a DELETE with resourceVersion (and UID) preconditions. Upstream soft-deletes
//! IPAM objects instead (a PUT with `deleted: true`, then a DELETE by UID); a Get that finds
//! such a leftover finishes the delete and answers NotFound. What was last read of each
//! object (revision, UID, value) is remembered for the life of the call, so that a delete
//! does not need to read the object again. The cluster's configuration is read from the
//! API server's watch cache (`CACHED`).

pub mod client;
pub mod core_objects;
pub mod crd;
pub mod names;
pub mod pods;
pub mod ratelimit;
pub mod transport;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use http::Method;
use k8s_openapi::api::core::v1::{Node as K8sNode, Pod};
use serde_json::{json, Value};

use self::client::{ApiResponse, KubeClient};
use self::core_objects::pod_path;
use self::crd::{crd_ref, from_cr, mark_deleted, to_cr, CrdRef, Group};
use super::{Datastore, DatastoreError, Key, Kind, KvPair, ListKind, Revision};
use crate::config::identifiers::parse_wep_name;

const STRATEGIC_MERGE: &str = "application/strategic-merge-patch+json";
const JSON: &str = "application/json";

/// What was last read or written of one object.
#[derive(Clone, Debug)]
struct Seen {
    revision: String,
    uid: String,
    value: Value,
}

pub struct KubeDatastore {
    client: Arc<KubeClient>,
    group: GroupChoice,
    seen: Mutex<HashMap<String, Seen>>,
    /// Answers to reads made ahead (`Datastore::prefetch`), by path, each taken by the first
    /// read of its object and dropped by a write of it.
    prefetched: Mutex<HashMap<String, ApiResponse>>,
}

/// Which API group Calico's custom resources are under: configured, or asked of the API
/// server once per call (`calico_api_group` empty).
enum GroupChoice {
    Configured(Group),
    Discover(tokio::sync::OnceCell<Group>),
}

/// An error answer, in libcalico-go's terms (`K8sErrorToCalico`).
pub fn api_error(key: &Key, resp: &ApiResponse) -> DatastoreError {
    let status = resp.status_object();
    let conflict_on = |field: &str| {
        status.details.as_ref().is_some_and(|d| {
            !d.causes.is_empty()
                && d.causes
                    .iter()
                    .all(|c| c.field == field && c.kind == "FieldValueInvalid")
        })
    };
    match resp.status {
        404 => DatastoreError::NotFound {
            key: key.describe(),
            cause: status.message,
        },
        409 if status.reason == "AlreadyExists" => DatastoreError::AlreadyExists(key.describe()),
        409 if status.message.contains("UID in precondition") => DatastoreError::NotFound {
            key: key.describe(),
            cause: status.message,
        },
        409 => DatastoreError::Conflict(key.describe()),
        401 | 403 => DatastoreError::Unauthorized(status.message),
        _ if conflict_on("metadata.uid") => DatastoreError::NotFound {
            key: key.describe(),
            cause: status.message,
        },
        _ if conflict_on("metadata.resourceVersion") => DatastoreError::Conflict(key.describe()),
        _ => DatastoreError::Status(status.message),
    }
}

fn decode<T: serde::de::DeserializeOwned>(key: &Key, v: Value) -> Result<T, DatastoreError> {
    serde_json::from_value(v).map_err(|e| DatastoreError::decode(key.describe(), e))
}

impl KubeDatastore {
    pub fn new(client: Arc<KubeClient>, group: Group) -> KubeDatastore {
        KubeDatastore {
            client,
            group: GroupChoice::Configured(group),
            seen: Mutex::new(HashMap::new()),
            prefetched: Mutex::new(HashMap::new()),
        }
    }

    /// A datastore whose API group the API server is asked for (`discovered`), once.
    pub fn discovering(client: Arc<KubeClient>) -> KubeDatastore {
        KubeDatastore {
            client,
            group: GroupChoice::Discover(tokio::sync::OnceCell::new()),
            seen: Mutex::new(HashMap::new()),
            prefetched: Mutex::new(HashMap::new()),
        }
    }

    /// The group requests go to now: the configured or discovered one, else (discovery
    /// not answered yet) the v1 CRDs, the group nearly every cluster serves.
    fn group(&self) -> Group {
        match &self.group {
            GroupChoice::Configured(g) => g.clone(),
            GroupChoice::Discover(cell) => cell.get().cloned().unwrap_or_default(),
        }
    }

    /// The group, asking the API server which it serves (`GET /apis`, libcalico-go's
    /// `UsingV3CRDs`) the first time; a failed discovery is the v1 CRDs, as upstream.
    async fn discovered(&self) -> Group {
        let cell = match &self.group {
            GroupChoice::Configured(g) => return g.clone(),
            GroupChoice::Discover(cell) => cell,
        };
        cell.get_or_init(|| async {
            let answer = match self.client.get("/apis").await {
                Ok(resp) if resp.ok() => resp.json(),
                Ok(resp) => Err(DatastoreError::Status(resp.status_object().message)),
                Err(e) => Err(e),
            };
            let group = match answer {
                Ok(list) => {
                    let names: Vec<&str> = list
                        .get("groups")
                        .and_then(Value::as_array)
                        .map(|g| {
                            g.iter()
                                .filter_map(|g| g.get("name").and_then(Value::as_str))
                                .collect()
                        })
                        .unwrap_or_default();
                    Group::from_served(&names)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "API group discovery failed; using the v1 CRDs");
                    Group::default()
                }
            };
            tracing::debug!(group = %group.api_version, "discovered Calico's API group");
            group
        })
        .await
        .clone()
    }

    /// Runs `op` (a request on Calico's custom resources, under `self.group()`). While the
    /// group is not known yet, `op` goes to the v1 CRDs and the discovery runs alongside it
    /// (the same round trip); only when the server turns out to serve the v3 CRDs instead
    /// is `op` made again there (where the v1 group is not served, the first attempt found
    /// nothing and changed nothing).
    async fn in_group<T, F, Fut>(&self, op: F) -> Result<T, DatastoreError>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<T, DatastoreError>>,
    {
        let guess = match &self.group {
            GroupChoice::Discover(cell) if cell.get().is_none() => self.group(),
            _ => return op().await,
        };
        let (first, decided) = tokio::join!(op(), self.discovered());
        if decided == guess {
            return first;
        }
        op().await
    }

    /// `Datastore::prefetch`: the custom resources among `keys`, read together (in the
    /// group as known now: should discovery move them, their answers are never taken). A
    /// read that fails is not kept: the later read makes its own request.
    pub async fn prefetch_keys(&self, keys: &[Key]) {
        let group = self.group();
        let paths = keys
            .iter()
            .filter_map(|k| crd_ref(k, &group))
            .map(|cr| group.object(cr.plural, &cr.name));
        let reads = paths.map(|path| async move {
            let answer = self.client.get(&path).await;
            (path, answer)
        });
        for (path, answer) in futures::future::join_all(reads).await {
            if let (Ok(resp), Ok(mut m)) = (answer, self.prefetched.lock()) {
                m.insert(path, resp);
            }
        }
    }

    /// The API client, for the plugin's own reads (pods, namespaces, nodes).
    pub fn client(&self) -> &Arc<KubeClient> {
        &self.client
    }

    fn remember(&self, path: &str, seen: Seen) {
        self.take_prefetched(path);
        if let Ok(mut m) = self.seen.lock() {
            m.insert(path.to_string(), seen);
        }
    }

    /// The answer of a read of `path` made ahead, if there is one (once).
    fn take_prefetched(&self, path: &str) -> Option<ApiResponse> {
        self.prefetched.lock().ok().and_then(|mut m| m.remove(path))
    }

    fn recall(&self, path: &str) -> Option<Seen> {
        self.seen.lock().ok().and_then(|m| m.get(path).cloned())
    }

    fn forget(&self, path: &str) {
        self.take_prefetched(path);
        if let Ok(mut m) = self.seen.lock() {
            m.remove(path);
        }
    }

    // ---- custom resources ----

    fn stored(&self, key: &Key, path: &str, resp: &ApiResponse) -> Result<KvPair, DatastoreError> {
        let got = from_cr(key, &resp.json()?)?;
        self.remember(
            path,
            Seen {
                revision: got.revision.clone(),
                uid: got.uid.clone(),
                value: got.value.clone(),
            },
        );
        Ok(KvPair {
            key: key.clone(),
            value: got.value,
            revision: got.revision,
        })
    }

    async fn get_cr(&self, key: &Key, cr: &CrdRef) -> Result<KvPair, DatastoreError> {
        let path = self.group().object(cr.plural, &cr.name);
        let resp = match self.take_prefetched(&path) {
            Some(resp) => resp,
            None => self.client.get(&path).await?,
        };
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        let got = from_cr(key, &resp.json()?)?;
        if got.deleted {
            // A delete that did not finish: finish it, as upstream's Get does. Only once it
            // is finished (or was, by someone else) is the object not found; a DELETE that
            // fails is this read's error, so that the caller (a DEL releasing the handle)
            // fails and is retried instead of taking the object, still stored, for gone.
            match self.delete_by_uid(key, &path, &got.uid).await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e),
            }
            return Err(DatastoreError::NotFound {
                key: key.describe(),
                cause: "Resource was deleted".into(),
            });
        }
        self.stored(key, &path, &resp)
    }

    async fn write_cr(
        &self,
        key: &Key,
        cr: &CrdRef,
        value: &Value,
        revision: Option<&str>,
    ) -> Result<Revision, DatastoreError> {
        let obj = to_cr(key, value, cr, &self.group(), revision, None)?;
        let path = self.group().object(cr.plural, &cr.name);
        let resp = match revision {
            None => {
                self.client
                    .send_json(
                        Method::POST,
                        &self.group().collection(cr.plural),
                        JSON,
                        &obj,
                    )
                    .await?
            }
            Some(_) => {
                self.client
                    .send_json(Method::PUT, &path, JSON, &obj)
                    .await?
            }
        };
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        Ok(self.stored(key, &path, &resp)?.revision)
    }

    async fn delete_by_uid(&self, key: &Key, path: &str, uid: &str) -> Result<(), DatastoreError> {
        let preconditions = (!uid.is_empty()).then(|| json!({ "uid": uid }));
        self.delete_at(key, path, preconditions).await
    }

    /// One DELETE of `path`, with `preconditions` when given; what was remembered of the
    /// object is forgotten whatever the answer.
    async fn delete_at(
        &self,
        key: &Key,
        path: &str,
        preconditions: Option<Value>,
    ) -> Result<(), DatastoreError> {
        let mut opts = json!({"kind": "DeleteOptions", "apiVersion": "v1"});
        if let Some(p) = preconditions {
            opts["preconditions"] = p;
        }
        let resp = self
            .client
            .send_json(Method::DELETE, path, JSON, &opts)
            .await?;
        self.forget(path);
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        Ok(())
    }

    async fn delete_cr(
        &self,
        key: &Key,
        cr: &CrdRef,
        revision: Option<&str>,
    ) -> Result<(), DatastoreError> {
        let path = self.group().object(cr.plural, &cr.name);
        if let Key::Resource { .. } | Key::IpamConfig = key {
            let preconditions = revision
                .filter(|r| !r.is_empty())
                .map(|rv| json!({ "resourceVersion": rv }));
            return self.delete_at(key, &path, preconditions).await;
        }
        // Compare-and-delete, one request: the DELETE's preconditions name the revision (and
        // the UID, when known). Upstream marks the object deleted first (an update at that
        // revision) and then deletes it by UID, two round trips, because its client had no
        // compare-and-delete; for every reader both end the same way: the object is gone if,
        // and only if, it was still at that revision (else a conflict, and nothing changed).
        if let Some(rv) = revision.filter(|r| !r.is_empty()) {
            let uid = self
                .recall(&path)
                .filter(|s| s.revision == rv)
                .map(|s| s.uid)
                .unwrap_or_default();
            let mut preconditions = json!({ "resourceVersion": rv });
            if !uid.is_empty() {
                preconditions["uid"] = json!(uid);
            }
            return self.delete_at(key, &path, Some(preconditions)).await;
        }
        // Unconditional: the value as last seen, marked deleted, CAS-written (read afresh on
        // a conflict); then the DELETE by UID.
        let mut remembered = self.recall(&path);
        let mut attempts = 0;
        let current = loop {
            attempts += 1;
            let current = match remembered.take() {
                Some(s) if revision.is_none_or(|r| r == s.revision) => s,
                _ => {
                    let got = self.get_cr(key, cr).await?;
                    self.recall(&path).unwrap_or(Seen {
                        revision: got.revision,
                        uid: String::new(),
                        value: got.value,
                    })
                }
            };
            if let Some(r) = revision.filter(|r| *r != current.revision) {
                tracing::debug!(revision = r, current = %current.revision, "stale delete");
                return Err(DatastoreError::Conflict(key.describe()));
            }
            match self
                .write_cr(
                    key,
                    cr,
                    &mark_deleted(key, &current.value),
                    Some(&current.revision),
                )
                .await
            {
                Ok(_) => break current,
                // Without a revision the delete is unconditional: a conflict only says that
                // what we remembered (or read) is stale, as after another client's write.
                // Read it afresh and mark that deleted (a bounded number of times).
                Err(e) if e.is_conflict() && revision.is_none() && attempts < 5 => {
                    self.forget(&path);
                }
                Err(e) => {
                    if e.is_conflict() {
                        self.forget(&path);
                    }
                    return Err(e);
                }
            }
        };
        let uid = self.recall(&path).map(|s| s.uid).unwrap_or(current.uid);
        self.delete_by_uid(key, &path, &uid).await
    }

    /// The custom resources of `plural`, read at the latest revision (a quorum read, as
    /// upstream's: never the watch cache's moment behind).
    async fn list_crs(&self, plural: &str, query: &str) -> Result<Vec<Value>, DatastoreError> {
        let mut path = self.group().collection(plural);
        if !query.is_empty() {
            path.push('?');
            path.push_str(query);
        }
        let resp = self.client.get(&path).await?;
        if !resp.ok() {
            // A list names no key: the collection stands in for it.
            let status = resp.status_object();
            return Err(match resp.status {
                404 => DatastoreError::NotFound {
                    key: format!("{}({plural})", self.group().api_version),
                    cause: status.message,
                },
                401 | 403 => DatastoreError::Unauthorized(status.message),
                _ => DatastoreError::Status(status.message),
            });
        }
        let list = resp.json()?;
        Ok(list
            .get("items")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default())
    }

    async fn list_keyed(
        &self,
        plural: &str,
        query: &str,
        key_of: impl Fn(&Value) -> Option<Key>,
    ) -> Result<Vec<KvPair>, DatastoreError> {
        let mut out = Vec::new();
        for item in self.list_crs(plural, query).await? {
            let Some(key) = key_of(&item) else { continue };
            let got = from_cr(&key, &item)?;
            if let Some(cr) = crd_ref(&key, &self.group()) {
                self.remember(
                    &self.group().object(cr.plural, &cr.name),
                    Seen {
                        revision: got.revision.clone(),
                        uid: got.uid.clone(),
                        value: got.value.clone(),
                    },
                );
            }
            out.push(KvPair {
                key,
                value: got.value,
                revision: got.revision,
            });
        }
        Ok(out)
    }

    // ---- pods as workload endpoints ----

    async fn get_pod(&self, key: &Key, namespace: &str, pod: &str) -> Result<Pod, DatastoreError> {
        let resp = self.client.get(&pod_path(namespace, pod)).await?;
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        decode(key, resp.json()?)
    }

    /// The endpoint of a pod, as a v3 WorkloadEndpoint value.
    fn endpoint_pair(&self, pod: &Pod) -> Result<Option<KvPair>, DatastoreError> {
        let spec = pod.spec.as_ref();
        let scheduled = spec
            .and_then(|s| s.node_name.as_deref())
            .is_some_and(|n| !n.is_empty());
        if !scheduled || spec.and_then(|s| s.host_network).unwrap_or(false) {
            return Ok(None);
        }
        let wep = pods::pod_to_endpoint(pod).map_err(DatastoreError::PodConversion)?;
        let ns = wep.metadata.namespace.clone();
        let name = wep.metadata.name.clone();
        let revision = wep.metadata.resource_version.clone();
        let value = serde_json::to_value(&wep).map_err(DatastoreError::encode)?;
        self.remember(
            &pod_path(&ns, &wep.spec.pod),
            Seen {
                revision: revision.clone(),
                uid: wep.metadata.uid.clone(),
                value: Value::Null,
            },
        );
        Ok(Some(KvPair {
            key: Key::Resource {
                kind: Kind::WorkloadEndpoint,
                namespace: Some(ns),
                name,
            },
            value,
            revision,
        }))
    }

    /// The endpoint of pod `namespace/pod`, whichever node it runs on: `None` when there is
    /// no such pod, or it is not scheduled or uses host networking. For the CNI's DEL when
    /// it does not know the node name, which is part of the endpoint's name (and which this
    /// datastore never reads from the name: the pod's `spec.nodeName` is the node).
    pub async fn endpoint_of_pod(
        &self,
        namespace: &str,
        pod: &str,
    ) -> Result<Option<KvPair>, DatastoreError> {
        // The key only names the object in error texts.
        let key = Key::Resource {
            kind: Kind::WorkloadEndpoint,
            namespace: Some(namespace.to_string()),
            name: pod.to_string(),
        };
        match self.get_pod(&key, namespace, pod).await {
            Ok(p) => self.endpoint_pair(&p),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The pod whose endpoint `key` names. This datastore holds only pods' endpoints;
    /// another name is refused as libcalico-go's endpoint client refuses it, which depends
    /// on what was asked (`op`).
    fn pod_of(key: &Key, op: EndpointOp) -> Result<(String, String), DatastoreError> {
        let Key::Resource {
            namespace, name, ..
        } = key
        else {
            return Err(DatastoreError::Other("not an endpoint key".into()));
        };
        // A list names a prefix (`<node>-k8s-<pod>-`): any interface completes it.
        let full = match op {
            EndpointOp::List => format!("{name}eth0"),
            _ => name.clone(),
        };
        let ids = parse_wep_name(&full);
        match ids {
            Some(ids) if !ids.pod.is_empty() && ids.orchestrator == "k8s" => {
                Ok((namespace.clone().unwrap_or_default(), ids.pod))
            }
            _ => Err(match op {
                EndpointOp::Get | EndpointOp::List => DatastoreError::NotFound {
                    key: match op {
                        EndpointOp::List => {
                            format!(
                                "WorkloadEndpoint({}/{}*)",
                                namespace.as_deref().unwrap_or_default(),
                                name
                            )
                        }
                        _ => key.describe(),
                    },
                    cause: "malformed WorkloadEndpoint name - unable to determine Pod name".into(),
                },
                EndpointOp::Write => DatastoreError::InsufficientIdentifiers(name.clone()),
            }),
        }
    }

    async fn get_endpoint(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        let (ns, pod) = Self::pod_of(key, EndpointOp::Get)?;
        let p = self.get_pod(key, &ns, &pod).await?;
        let pair = self
            .endpoint_pair(&p)?
            .ok_or_else(|| DatastoreError::NotFound {
                key: key.describe(),
                cause: "pod is not scheduled or uses host networking".into(),
            })?;
        // The pod's endpoint is the one of that name only (as libcalico-go's Get: another
        // interface of the pod is not found).
        match &pair.key {
            Key::Resource { name, .. } if Some(name.as_str()) != key_name(key) => {
                Err(DatastoreError::NotFound {
                    key: key.describe(),
                    cause: format!(
                        "workloadendpoints.projectcalico.org \"{}\" not found",
                        key_name(key).unwrap_or_default()
                    ),
                })
            }
            _ => Ok(pair),
        }
    }

    async fn patch_pod(
        &self,
        key: &Key,
        ns: &str,
        pod: &str,
        patch: &Value,
    ) -> Result<Revision, DatastoreError> {
        let path = format!("{}/status", pod_path(ns, pod));
        let resp = self
            .client
            .send_json(Method::PATCH, &path, STRATEGIC_MERGE, patch)
            .await?;
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        let p: Pod = decode(key, resp.json()?)?;
        Ok(p.metadata.resource_version.unwrap_or_default())
    }

    async fn write_endpoint(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
        let (ns, pod) = Self::pod_of(key, EndpointOp::Write)?;
        let ips: Vec<String> = value
            .pointer("/spec/ipNetworks")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let cid = value
            .pointer("/spec/containerID")
            .and_then(Value::as_str)
            .unwrap_or_default();
        self.patch_pod(key, &ns, &pod, &pods::add_patch(&ips, cid))
            .await
    }

    async fn delete_endpoint(
        &self,
        key: &Key,
        revision: Option<&str>,
    ) -> Result<(), DatastoreError> {
        let (ns, pod) = Self::pod_of(key, EndpointOp::Write)?;
        let uid = self
            .recall(&pod_path(&ns, &pod))
            .map(|s| s.uid)
            .unwrap_or_default();
        let patch = pods::delete_patch(revision.unwrap_or_default(), &uid);
        self.patch_pod(key, &ns, &pod, &patch).await.map(|_| ())
    }

    // ---- nodes and profiles ----

    async fn get_node(&self, key: &Key, name: &str) -> Result<KvPair, DatastoreError> {
        let resp = self.client.get(&core_objects::node_path(name)).await?;
        if !resp.ok() {
            return Err(api_error(key, &resp));
        }
        let node: K8sNode = decode(key, resp.json()?)?;
        let revision = node.metadata.resource_version.clone().unwrap_or_default();
        let value = json!({
            "kind": "Node",
            "apiVersion": "projectcalico.org/v3",
            "metadata": {
                "name": name,
                "uid": node.metadata.uid.clone().unwrap_or_default(),
                "resourceVersion": revision,
                "labels": node.metadata.labels.clone().unwrap_or_default(),
            },
            "spec": {"orchRefs": [{"nodeName": name, "orchestrator": "k8s"}]},
        });
        Ok(KvPair {
            key: key.clone(),
            value,
            revision,
        })
    }

    /// Profiles are derived from namespaces (`kns.`) and service accounts (`ksa.`) and are
    /// read-only; any other name is refused as upstream refuses it.
    async fn get_profile(&self, key: &Key, name: &str) -> Result<KvPair, DatastoreError> {
        let Some((prefix, rest)) = name.split_once('.') else {
            return Err(DatastoreError::Other(format!("Invalid name {name}")));
        };
        match prefix {
            "kns" => {
                let resp = self.client.get(&core_objects::namespace_path(rest)).await?;
                if !resp.ok() {
                    return Err(api_error(key, &resp));
                }
                let v = resp.json()?;
                let revision = v
                    .pointer("/metadata/resourceVersion")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_string();
                Ok(KvPair {
                    key: key.clone(),
                    value: json!({"kind": "Profile", "apiVersion": "projectcalico.org/v3",
                        "metadata": {"name": name, "resourceVersion": revision},
                        "spec": {"ingress": [{"action": "Allow"}], "egress": [{"action": "Allow"}]}}),
                    revision,
                })
            }
            "ksa" => Err(DatastoreError::Other(format!(
                "reading service account profile {name} is not supported by this plugin"
            ))),
            _ => Err(DatastoreError::Other("Revision  invalid".into())),
        }
    }

    fn read_only(key: &Key) -> DatastoreError {
        DatastoreError::Other(format!(
            "operation not supported on {}: the Kubernetes datastore derives it from the Kubernetes API",
            key.describe()
        ))
    }
}

fn key_name(key: &Key) -> Option<&str> {
    match key {
        Key::Resource { name, .. } => Some(name),
        _ => None,
    }
}

/// What is asked of a pod's endpoint (`KubeDatastore::pod_of`).
#[derive(Clone, Copy)]
enum EndpointOp {
    Get,
    List,
    Write,
}

/// The `Datastore` operations under the group requests go to now (`in_group` wraps them).
impl KubeDatastore {
    async fn get_in_current_group(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        if let Some(cr) = crd_ref(key, &self.group()) {
            return self.get_cr(key, &cr).await;
        }
        match key {
            Key::Resource {
                kind: Kind::WorkloadEndpoint,
                ..
            } => self.get_endpoint(key).await,
            Key::Resource {
                kind: Kind::Node,
                name,
                ..
            } => self.get_node(key, name).await,
            Key::Resource {
                kind: Kind::Profile,
                name,
                ..
            } => self.get_profile(key, name).await,
            _ => Err(Self::read_only(key)),
        }
    }

    async fn list_in_current_group(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        match what {
            ListKind::Resources {
                kind: Kind::WorkloadEndpoint,
                namespace,
                name_prefix,
            } => {
                // The CNI's lookup of one pod's endpoint: a Get of the pod.
                let prefix = name_prefix.clone().unwrap_or_default();
                // Named by the prefix: a name made of it and any interface names the same pod.
                let key = Key::Resource {
                    kind: Kind::WorkloadEndpoint,
                    namespace: namespace.clone(),
                    name: prefix.clone(),
                };
                let (ns, pod) = Self::pod_of(&key, EndpointOp::List)?;
                let p = match self.get_pod(&key, &ns, &pod).await {
                    Ok(p) => p,
                    Err(e) if e.is_not_found() => return Ok(Vec::new()),
                    Err(e) => return Err(e),
                };
                Ok(self
                    .endpoint_pair(&p)?
                    .into_iter()
                    .filter(|kv| match &kv.key {
                        Key::Resource { name, .. } => name.starts_with(&prefix),
                        _ => false,
                    })
                    .collect())
            }
            ListKind::Resources {
                kind,
                namespace,
                name_prefix,
            } => {
                let probe = Key::Resource {
                    kind: *kind,
                    namespace: namespace.clone(),
                    name: String::new(),
                };
                let Some(cr) = crd_ref(&probe, &self.group()) else {
                    return Err(Self::read_only(&probe));
                };
                let prefix = name_prefix.clone().unwrap_or_default();
                self.list_keyed(cr.plural, "", |item| {
                    let name = item.pointer("/metadata/name")?.as_str()?;
                    name.starts_with(&prefix).then(|| Key::Resource {
                        kind: *kind,
                        namespace: None,
                        name: name.to_string(),
                    })
                })
                .await
            }
            ListKind::Blocks { version } => {
                self.list_keyed("ipamblocks", "", |item| {
                    let cidr: crate::support::net::IpNet =
                        item.pointer("/spec/cidr")?.as_str()?.parse().ok()?;
                    version
                        .is_none_or(|v| cidr.version() == v)
                        .then_some(Key::Block { cidr })
                })
                .await
            }
            ListKind::Affinities { .. } => self.list_affinities(what).await,
            ListKind::Handles => {
                self.list_keyed("ipamhandles", "", |item| {
                    let id = item.pointer("/spec/handleID")?.as_str()?;
                    Some(Key::Handle { id: id.to_string() })
                })
                .await
            }
        }
    }

    /// This host's block affinities (`ListKind::Affinities`), by their labels.
    async fn list_affinities(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        let ListKind::Affinities {
            host,
            affinity_type,
            version,
        } = what
        else {
            return Err(DatastoreError::Other("not an affinity listing".into()));
        };
        let mut selector = format!(
            "{}={},{}={}",
            names::LABEL_AFFINITY_TYPE,
            affinity_type,
            names::LABEL_HOSTNAME_HASH,
            names::hostname_hash(host)
        );
        if let Some(v) = version {
            selector.push_str(&format!(",{}={v}", names::LABEL_IP_VERSION));
        }
        let query = format!("labelSelector={}", url_encode(&selector));
        let pairs = self
            .list_keyed("blockaffinities", &query, |item| {
                let spec = item.get("spec")?;
                let cidr: crate::support::net::IpNet = spec.get("cidr")?.as_str()?.parse().ok()?;
                let node = spec.get("node")?.as_str()?;
                let t = spec
                    .get("type")
                    .and_then(Value::as_str)
                    .filter(|t| !t.is_empty())
                    .unwrap_or("host");
                (node == host && t == affinity_type && version.is_none_or(|v| cidr.version() == v))
                    .then(|| Key::BlockAffinity {
                        host: host.clone(),
                        cidr,
                        affinity_type: affinity_type.clone(),
                    })
            })
            .await?;
        Ok(pairs
            .into_iter()
            .filter(|kv| kv.value.get("deleted") != Some(&Value::Bool(true)))
            .collect())
    }

    async fn create_in_current_group(
        &self,
        key: &Key,
        value: &Value,
    ) -> Result<Revision, DatastoreError> {
        if let Some(cr) = crd_ref(key, &self.group()) {
            return self.write_cr(key, &cr, value, None).await;
        }
        match key {
            Key::Resource {
                kind: Kind::WorkloadEndpoint,
                ..
            } => self.write_endpoint(key, value).await,
            _ => Err(Self::read_only(key)),
        }
    }

    async fn update_in_current_group(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        if let Some(cr) = crd_ref(key, &self.group()) {
            return self.write_cr(key, &cr, value, Some(revision)).await;
        }
        match key {
            // The endpoint patch deliberately carries no revision (upstream: the CNI owns
            // these annotations).
            Key::Resource {
                kind: Kind::WorkloadEndpoint,
                ..
            } => self.write_endpoint(key, value).await,
            _ => Err(Self::read_only(key)),
        }
    }

    /// `label_host_affinities` under the group requests go to now.
    async fn label_host_affinities_in_current_group(
        &self,
        node: &str,
    ) -> Result<usize, DatastoreError> {
        let query = format!(
            "labelSelector={}",
            url_encode(&format!("!{}", names::LABEL_AFFINITY_TYPE))
        );
        let mut labelled = 0;
        let mut failures: Vec<String> = Vec::new();
        for mut item in self.list_crs("blockaffinities", &query).await? {
            let spec = item.get("spec").cloned().unwrap_or_default();
            if spec.get("node").and_then(Value::as_str) != Some(node) {
                // Only this node's: every node upgrades its own, so none conflict.
                continue;
            }
            let (Some(name), Some(cidr)) = (
                item.pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                spec.get("cidr")
                    .and_then(Value::as_str)
                    .and_then(|c| c.parse::<crate::support::net::IpNet>().ok()),
            ) else {
                continue;
            };
            // An affinity from before the type existed is a host affinity (as every reader
            // of it takes it); upstream would label it with an empty type no lookup matches.
            let affinity_type = spec
                .get("type")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty())
                .unwrap_or("host");
            let labels = item
                .pointer_mut("/metadata")
                .and_then(Value::as_object_mut)
                .map(|m| m.entry("labels").or_insert_with(|| json!({})));
            if let Some(Value::Object(labels)) = labels {
                for (k, v) in names::affinity_labels(node, affinity_type, &cidr) {
                    labels.insert(k.to_string(), Value::String(v));
                }
            }
            let path = self.group().object("blockaffinities", &name);
            let resp = self
                .client
                .send_json(Method::PUT, &path, JSON, &item)
                .await?;
            if resp.ok() {
                labelled += 1;
            } else {
                let key = Key::BlockAffinity {
                    host: node.to_string(),
                    cidr,
                    affinity_type: affinity_type.to_string(),
                };
                failures.push(api_error(&key, &resp).to_string());
            }
        }
        if failures.is_empty() {
            Ok(labelled)
        } else {
            Err(DatastoreError::Other(format!(
                "failed to upgrade some block affinities: [{}]",
                failures.join(" ")
            )))
        }
    }

    async fn delete_in_current_group(
        &self,
        key: &Key,
        revision: Option<&str>,
    ) -> Result<(), DatastoreError> {
        if let Some(cr) = crd_ref(key, &self.group()) {
            return self.delete_cr(key, &cr, revision).await;
        }
        match key {
            Key::Resource {
                kind: Kind::WorkloadEndpoint,
                ..
            } => self.delete_endpoint(key, revision).await,
            _ => Err(Self::read_only(key)),
        }
    }
}

impl Datastore for KubeDatastore {
    async fn prefetch(&self, keys: &[Key]) {
        self.prefetch_keys(keys).await
    }

    fn keeps_block_copies(&self) -> bool {
        true
    }

    async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        match is_cr(key) {
            true => self.in_group(|| self.get_in_current_group(key)).await,
            false => self.get_in_current_group(key).await,
        }
    }

    async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        match what {
            ListKind::Resources {
                kind: Kind::WorkloadEndpoint,
                ..
            } => self.list_in_current_group(what).await,
            _ => self.in_group(|| self.list_in_current_group(what)).await,
        }
    }

    async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
        match is_cr(key) {
            true => {
                self.in_group(|| self.create_in_current_group(key, value))
                    .await
            }
            false => self.create_in_current_group(key, value).await,
        }
    }

    async fn update(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        match is_cr(key) {
            true => {
                self.in_group(|| self.update_in_current_group(key, value, revision))
                    .await
            }
            false => self.update_in_current_group(key, value, revision).await,
        }
    }

    async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError> {
        match is_cr(key) {
            true => {
                self.in_group(|| self.delete_in_current_group(key, revision))
                    .await
            }
            false => self.delete_in_current_group(key, revision).await,
        }
    }

    /// Lists the affinities without the affinity-type label (all nodes': the host-hash label
    /// is what is missing) and writes this node's back with the three labels, each a
    /// compare-and-swap on the revision listed. Labels already there are kept.
    async fn label_host_affinities(&self, node: &str) -> Result<usize, DatastoreError> {
        self.in_group(|| self.label_host_affinities_in_current_group(node))
            .await
    }
}

/// Whether `key` is stored as a Calico custom resource (in whichever group).
fn is_cr(key: &Key) -> bool {
    crd_ref(key, &Group::default()).is_some()
}

/// Percent-encodes a query value (label selectors: `=`, `,`, `/`, `!`, spaces).
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
