//! The datastore: one `Datastore` trait over typed keys and JSON values, shared by the
//! `calico` plugin and the IPAM allocator, with an etcd v3 backend (and, later, Kubernetes).
//!
//! Keys name objects the way libcalico-go's backend models do (`ResourceKey`, `BlockKey`,
//! `BlockAffinityKey`, `IPAMHandleKey`, `IPAMConfigKey`); each backend maps them to its own
//! storage (etcd key paths, Kubernetes REST paths). Values are the JSON upstream stores.

pub mod backend;
pub mod etcd;
pub mod kubernetes;
#[cfg(any(test, feature = "test-util"))]
pub mod memory;
pub mod model;
pub mod resources;
pub mod settings;
pub mod srv;
pub mod validate;

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use std::sync::Arc;

use crate::support::net::IpNet;

/// An opaque object revision: etcd's ModRevision in decimal, or a Kubernetes resourceVersion.
pub type Revision = String;

/// The v3 resource kinds this plugin touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    WorkloadEndpoint,
    IpPool,
    ClusterInformation,
    Profile,
    Node,
    IpReservation,
    /// The v3 IPAMConfiguration resource (`default`), which the plugin only reads (the
    /// KubeVirt setting). On etcd a key of its own; on the Kubernetes datastore the same
    /// custom resource as the allocator's IPAMConfig.
    IpamConfiguration,
}

impl Kind {
    /// The kind name as written in `"kind"`.
    pub fn name(self) -> &'static str {
        match self {
            Kind::WorkloadEndpoint => "WorkloadEndpoint",
            Kind::IpPool => "IPPool",
            Kind::ClusterInformation => "ClusterInformation",
            Kind::Profile => "Profile",
            Kind::Node => "Node",
            Kind::IpReservation => "IPReservation",
            Kind::IpamConfiguration => "IPAMConfiguration",
        }
    }

    /// The lower-case plural used in key paths.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::WorkloadEndpoint => "workloadendpoints",
            Kind::IpPool => "ippools",
            Kind::ClusterInformation => "clusterinformations",
            Kind::Profile => "profiles",
            Kind::Node => "nodes",
            Kind::IpReservation => "ipreservations",
            Kind::IpamConfiguration => "ipamconfigurations",
        }
    }

    pub fn namespaced(self) -> bool {
        matches!(self, Kind::WorkloadEndpoint)
    }
}

/// A datastore object's identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    /// A projectcalico.org/v3 resource (namespace only for namespaced kinds).
    Resource {
        kind: Kind,
        namespace: Option<String>,
        name: String,
    },
    /// An IPAM allocation block, by its (masked) CIDR.
    Block { cidr: IpNet },
    /// A host's affinity to a block (`affinity_type` "host" for pods, "virtual" for LBs).
    BlockAffinity {
        host: String,
        cidr: IpNet,
        affinity_type: String,
    },
    /// An IPAM handle, by its ID (case kept).
    Handle { id: String },
    /// The global IPAM configuration.
    IpamConfig,
}

impl Key {
    pub fn resource(kind: Kind, namespace: Option<&str>, name: &str) -> Key {
        Key::Resource {
            kind,
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
        }
    }

    pub fn host_affinity(host: &str, cidr: IpNet) -> Key {
        Key::BlockAffinity {
            host: host.to_string(),
            cidr,
            affinity_type: "host".to_string(),
        }
    }
}

impl Key {
    /// libcalico-go's text for the key in not-found / already-exists / conflict errors
    /// (`BlockAffinityKey(cidr=…, host=…, affinityType=…)`, `WorkloadEndpoint(ns/name)`):
    /// the same whichever backend stored it.
    pub fn describe(&self) -> String {
        match self {
            Key::Resource {
                kind,
                namespace,
                name,
            } => match namespace {
                Some(ns) if kind.namespaced() => format!("{}({ns}/{name})", kind.name()),
                _ => format!("{}({name})", kind.name()),
            },
            Key::Block { cidr } => format!("BlockKey(cidr={})", cidr.masked()),
            Key::BlockAffinity {
                host,
                cidr,
                affinity_type,
            } => format!(
                "BlockAffinityKey(cidr={}, host={host}, affinityType={affinity_type})",
                cidr.masked()
            ),
            Key::Handle { id } => format!("IPAMHandleKey(id={id})"),
            Key::IpamConfig => "IPAMConfigKey()".to_string(),
        }
    }
}

/// What to list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListKind {
    /// All resources of a kind, optionally in one namespace, optionally whose name starts
    /// with `name_prefix` (the CNI's WEP lookup).
    Resources {
        kind: Kind,
        namespace: Option<String>,
        name_prefix: Option<String>,
    },
    /// All blocks, or those of one IP version.
    Blocks { version: Option<u8> },
    /// A host's affinities of one type and (optionally) one IP version.
    Affinities {
        host: String,
        affinity_type: String,
        version: Option<u8>,
    },
    /// All IPAM handles.
    Handles,
}

/// One stored object.
#[derive(Clone, Debug, PartialEq)]
pub struct KvPair {
    pub key: Key,
    pub value: Value,
    pub revision: Revision,
}

impl KvPair {
    /// The value as a typed model object.
    pub fn decode<T: DeserializeOwned>(&self) -> Result<T, DatastoreError> {
        serde_json::from_value(self.value.clone())
            .map_err(|e| DatastoreError::decode(format!("{:?}", self.key), e))
    }
}

/// A client library's error (etcd's, HTTP's, serde's), kept with its type. Shared, as a
/// `DatastoreError` is cloned: one failed batch of reads is the answer of each read in it.
#[derive(Clone, Debug)]
pub struct ClientError(Arc<dyn std::error::Error + Send + Sync>);

impl ClientError {
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> ClientError {
        ClientError(Arc::new(e))
    }
}

impl std::fmt::Display for ClientError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for ClientError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// Errors from any backend, in libcalico-go's vocabulary (the texts match its `errors` package).
#[derive(Debug, thiserror::Error, Clone)]
pub enum DatastoreError {
    /// `key` is `Key::describe()`; `cause` the backend's own error (`<nil>` on etcd, the API
    /// server's message on Kubernetes), as libcalico-go's `ErrorResourceDoesNotExist` prints.
    #[error("resource does not exist: {key} with error: {cause}")]
    NotFound { key: String, cause: String },
    #[error("resource already exists: {0}")]
    AlreadyExists(String),
    #[error("update conflict: {0}")]
    Conflict(String),
    /// No answer came (a timeout, a batch answered short): the request's outcome is unknown.
    #[error("error connecting to the datastore: {0}")]
    Unavailable(String),
    /// The client library failed the request: its outcome is unknown.
    #[error("error connecting to the datastore: {0}")]
    Client(#[source] ClientError),
    /// The same, for one API request (`GET /api/v1/...`).
    #[error("error connecting to the datastore: {request}: {source}")]
    Request {
        request: String,
        #[source]
        source: ClientError,
    },
    /// A request that could not be made (nothing was sent).
    #[error("{0}")]
    InvalidRequest(#[source] ClientError),
    /// No connection could be made to any of the endpoints.
    #[error("error connecting to the datastore: {source} (endpoints {endpoints:?})")]
    Connect {
        endpoints: Vec<String>,
        #[source]
        source: ClientError,
    },
    /// The call's deadline passed before the datastore answered (or before the request
    /// was sent): the request's outcome is unknown.
    #[error(transparent)]
    Deadline(#[from] crate::support::deadline::Expired),
    /// A 401 / 403 from the API server.
    #[error("connection is unauthorized: {0}")]
    Unauthorized(String),
    #[error("failed to decode {key}: {source}")]
    Decode {
        key: String,
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// A stored field that does not parse (`reason` in upstream's words).
    #[error("failed to decode {key}: {reason}")]
    InvalidField { key: String, reason: String },
    /// A value that does not serialise for writing.
    #[error(transparent)]
    Encode(Arc<serde_json::Error>),
    /// An object named without the identifiers this datastore needs (a non-pod endpoint
    /// on the Kubernetes datastore).
    #[error("insufficient identifiers, missing '{0}'")]
    InsufficientIdentifiers(String),
    /// A pod whose annotations do not make a WorkloadEndpoint, in the words of
    /// libcalico-go's converter (which upstream returns as they are).
    #[error("{0}")]
    PodConversion(String),
    /// A Kubernetes object the API server sent that does not decode as its kind.
    #[error("invalid object from the API server at {path}: {source}")]
    InvalidObject {
        path: String,
        #[source]
        source: Arc<serde_json::Error>,
    },
    /// The client-side rate limit refused the request (it was not sent).
    #[error(transparent)]
    Throttled(crate::datastore::kubernetes::ratelimit::Refused),
    /// The API server's body is not JSON.
    #[error("invalid JSON from the API server: {0}")]
    InvalidJson(#[source] Arc<serde_json::Error>),
    /// The API server refused the request: its status message.
    #[error("{0}")]
    Status(String),
    /// Settings that do not make a client (client-go's and etcd's words).
    #[error("{0}")]
    Config(String),
    /// A condition found here, in upstream's words.
    #[error("{0}")]
    Other(String),
}

impl DatastoreError {
    /// A value that does not serialise (or, written, does not read back as its type).
    pub fn encode(e: serde_json::Error) -> DatastoreError {
        DatastoreError::Encode(Arc::new(e))
    }
    /// A stored value that does not decode as its type.
    pub fn decode(key: impl Into<String>, e: serde_json::Error) -> DatastoreError {
        DatastoreError::Decode {
            key: key.into(),
            source: Arc::new(e),
        }
    }
    /// The key is absent (etcd's wording: no underlying error).
    pub fn not_found(key: &Key) -> DatastoreError {
        DatastoreError::NotFound {
            key: key.describe(),
            cause: "<nil>".into(),
        }
    }
    pub fn is_not_found(&self) -> bool {
        matches!(self, DatastoreError::NotFound { .. })
    }
    pub fn is_conflict(&self) -> bool {
        matches!(self, DatastoreError::Conflict(_))
    }
    pub fn is_already_exists(&self) -> bool {
        matches!(self, DatastoreError::AlreadyExists(_))
    }
    pub fn is_deadline(&self) -> bool {
        matches!(self, DatastoreError::Deadline(_))
    }
    /// Whether the request may have been carried out all the same: no answer came, rather
    /// than a refusal.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            DatastoreError::Deadline(_)
                | DatastoreError::Unavailable(_)
                | DatastoreError::Client(_)
                | DatastoreError::Request { .. }
        )
    }
    /// The call's deadline, when that is what this error is.
    pub fn deadline(&self) -> Option<&crate::support::deadline::Expired> {
        match self {
            DatastoreError::Deadline(e) => Some(e),
            _ => None,
        }
    }
}

/// Typed get / list / create / update (CAS) / delete (optionally CAS).
///
/// Resource values carry full v3 objects; on read `metadata.resourceVersion` is filled from
/// the revision; on write it is never stored. Block/affinity/handle/config values are the
/// bare model JSON.
#[allow(async_fn_in_trait)]
pub trait Datastore {
    async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError>;
    async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError>;
    /// Create if absent; `AlreadyExists` otherwise. Returns the new revision.
    async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError>;
    /// Compare-and-swap on `revision`; `Conflict` when it moved, `NotFound` when gone.
    async fn update(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError>;
    /// Delete, compare-and-swap when a revision is given.
    async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError>;

    /// Creates `create` (absent) and compare-and-swaps `update` on its revision, both or
    /// neither, in one request, where the backend can (etcd: one transaction); `None` where
    /// it cannot (the caller then writes them one after the other). Returns the revision of
    /// the write. A refusal names the first compare that failed: `AlreadyExists` for the
    /// created key, else `Conflict` or `NotFound` for the updated one; any other error leaves
    /// the outcome unknown, as for any write.
    async fn create_and_update(
        &self,
        create: (&Key, &Value),
        update: (&Key, &Value, &str),
    ) -> Option<Result<Revision, DatastoreError>> {
        let _ = (create, update);
        None
    }

    /// Reads `keys` now, so that the first `get` of each later in this call takes that
    /// answer instead of making a request of its own: the read moves one or more round
    /// trips earlier, joined with other reads, and is otherwise the same read (every write
    /// that follows it is a compare-and-swap, as after any read; a write of the key, or its
    /// delete, drops the answer). Both production datastores answer it (etcd sends the keys
    /// in the transaction of the reads made beside them); the test stores do nothing.
    async fn prefetch(&self, keys: &[Key]) {
        let _ = keys;
    }

    /// Whether IPAM keeps the blocks it writes for the host's next IPAM lock holder and
    /// takes them from there (`BlockCopies`): where a block's read is a request of its own
    /// made while the host's other calls wait for the lock (the Kubernetes API). On etcd it
    /// rides in the transaction of the other reads, and a copy would save nothing.
    fn keeps_block_copies(&self) -> bool {
        false
    }

    /// Gives `node`'s block affinities written by older releases the labels host lookups
    /// select on (libcalico-go `UpgradeHost`); returns how many were labelled. Only the
    /// Kubernetes datastore stores affinities as labelled objects: elsewhere there is
    /// nothing to do (upstream's list finds nothing on etcd).
    async fn label_host_affinities(&self, node: &str) -> Result<usize, DatastoreError> {
        let _ = node;
        Ok(0)
    }
}

/// Serialises a model value for writing.
pub fn to_value<T: Serialize>(v: &T) -> Result<Value, DatastoreError> {
    serde_json::to_value(v).map_err(DatastoreError::encode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn causes_stay_typed_and_texts_are_upstreams() {
        let bad = serde_json::from_str::<Value>("{").unwrap_err();
        let text = bad.to_string();
        let e = DatastoreError::decode("/calico/ipam/v2/host/h", bad);
        assert_eq!(
            e.to_string(),
            format!("failed to decode /calico/ipam/v2/host/h: {text}")
        );
        let cause = e
            .source()
            .and_then(|s| s.downcast_ref::<Arc<serde_json::Error>>());
        assert!(cause.is_some(), "{e:?}");

        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset");
        let e = DatastoreError::Request {
            request: "GET /api/v1/namespaces/default".into(),
            source: ClientError::new(io),
        };
        assert_eq!(
            e.to_string(),
            "error connecting to the datastore: GET /api/v1/namespaces/default: connection reset"
        );
        assert!(e.outcome_unknown());
    }

    #[test]
    fn only_unanswered_requests_have_an_unknown_outcome() {
        let io = || ClientError::new(std::io::Error::other("refused"));
        let unknown = [
            DatastoreError::Unavailable("timed out".into()),
            DatastoreError::Client(io()),
        ];
        let refused = [
            DatastoreError::Conflict("k".into()),
            DatastoreError::Status("forbidden".into()),
            DatastoreError::InvalidRequest(io()),
            DatastoreError::Connect {
                endpoints: vec!["http://127.0.0.1:1".into()],
                source: io(),
            },
        ];
        assert!(unknown.iter().all(DatastoreError::outcome_unknown));
        assert!(!refused.iter().any(DatastoreError::outcome_unknown));
    }
}
