//! The datastore a call uses: etcd v3 or the Kubernetes API, chosen by the resolved
//! settings (`datastore::settings`). `Backend` dispatches the `Datastore` trait statically;
//! `connect` is the one factory. The Kubernetes client is only built when selected.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use super::etcd::{EtcdConfig, EtcdDatastore};
use super::kubernetes::client::KubeClient;
use super::kubernetes::crd::Group;
use super::kubernetes::KubeDatastore;
use super::settings::DatastoreSettings;
use super::{srv, Datastore, DatastoreError, Key, KvPair, ListKind, Revision};
use crate::config::NetConf;

/// Per-request (and connect) timeout: a dead datastore fails a call instead of hanging it.
pub const DATASTORE_TIMEOUT: Duration = Duration::from_secs(5);

// One per process, never moved around: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Backend {
    Etcd(EtcdDatastore),
    Kubernetes(KubeDatastore),
}

impl Backend {
    /// The Kubernetes API client when this is the Kubernetes datastore (the plugin reuses
    /// its connection for pods and namespaces).
    pub fn kube_client(&self) -> Option<&Arc<KubeClient>> {
        match self {
            Backend::Kubernetes(k) => Some(k.client()),
            Backend::Etcd(e) => e.policy_client(),
        }
    }

    pub fn is_kubernetes(&self) -> bool {
        matches!(self, Backend::Kubernetes(_))
    }

    /// The API client for the plugins' own reads (pods, namespaces, nodes): this
    /// datastore's connection when it is the Kubernetes datastore reached the same way (one
    /// connection for everything), else a new one from the NetConf (`kubernetes.kubeconfig`,
    /// `policy.k8s_*`). Either way with the rate limit of upstream's own client for these
    /// reads (client-go's default), not the datastore's.
    pub async fn plugin_kube_client(
        &self,
        conf: &NetConf,
    ) -> Result<Arc<KubeClient>, DatastoreError> {
        let wanted = DatastoreSettings::plugin_kube(conf);
        if let Some(c) = self.kube_client() {
            if c.settings().same_server(&wanted) || wanted.is_empty() {
                if c.settings().rate == wanted.rate {
                    return Ok(c.clone());
                }
                return Ok(Arc::new(c.with_rate(wanted.rate)?));
            }
        }
        Ok(Arc::new(KubeClient::new(&wanted, DATASTORE_TIMEOUT).await?))
    }
}

/// Connects to the datastore the settings name (errors are upstream's bare texts).
pub async fn connect(s: &DatastoreSettings) -> Result<Backend, DatastoreError> {
    if s.datastore_type == "kubernetes" {
        let client = Arc::new(KubeClient::new(&s.kube, DATASTORE_TIMEOUT).await?);
        return Ok(Backend::Kubernetes(
            match Group::configured(&s.calico_api_group) {
                Some(group) => KubeDatastore::new(client, group),
                None => KubeDatastore::discovering(client),
            },
        ));
    }
    let endpoints = etcd_endpoints(s).await?;
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_string());
    let cfg = EtcdConfig {
        endpoints,
        key_file: opt(&s.etcd_key_file),
        cert_file: opt(&s.etcd_cert_file),
        ca_cert_file: opt(&s.etcd_ca_cert_file),
        username: opt(&s.etcd_username),
        password: opt(&s.etcd_password),
        timeout: DATASTORE_TIMEOUT,
    };
    // With policy type k8s, the API client is made while etcd is connected to, and its
    // connection opened in the background (`KubeClient::open_soon`): the pod's reads then
    // find it open, or join its opening. Best effort: a client that cannot be made is left
    // out, and the reads make their own and report why.
    let policy = async {
        let k = s.policy_kube.as_ref()?;
        match KubeClient::new(k, DATASTORE_TIMEOUT).await {
            Ok(c) => {
                let c = Arc::new(c);
                c.open_soon();
                Some(c)
            }
            Err(e) => {
                tracing::debug!(error = %e, "no early API client for policy type k8s");
                None
            }
        }
    };
    let (etcd, policy) = tokio::join!(EtcdDatastore::connect(&cfg), policy);
    Ok(Backend::Etcd(etcd?.with_policy_client(policy)))
}

/// The configured endpoints, or those DNS SRV discovery finds (libcalico-go etcdv3.go).
async fn etcd_endpoints(s: &DatastoreSettings) -> Result<Vec<String>, DatastoreError> {
    let config = |m: &str| DatastoreError::Config(m.to_string());
    if !s.etcd_discovery_srv.is_empty() && !s.etcd_endpoints.is_empty() {
        return Err(config("multiple discovery or bootstrap options specified, use either \"etcdEndpoints\" or \"etcdDiscoverySrv\""));
    }
    let endpoints = if s.etcd_discovery_srv.is_empty() {
        s.etcd_endpoints.clone()
    } else {
        srv::discover_etcd_endpoints(&s.etcd_discovery_srv)
            .await
            .map_err(|e| {
                config(&format!(
                    "failed to discover etcd endpoints through SRV discovery: {e}"
                ))
            })?
    };
    if endpoints.is_empty() {
        return Err(config("no etcd endpoints specified"));
    }
    Ok(endpoints)
}

/// The backends' request futures are boxed here: an etcd request's future is ~3.5 KB (tonic
/// and tower state), and a call keeps many of them in its state machine at once (joined
/// reads), which lived on the main thread's stack (an ADD touched ~0.7 MB of it). One small
/// allocation per request instead.
impl Datastore for Backend {
    fn keeps_block_copies(&self) -> bool {
        self.is_kubernetes()
    }

    async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        match self {
            Backend::Etcd(d) => Box::pin(d.get(key)).await,
            Backend::Kubernetes(d) => Box::pin(d.get(key)).await,
        }
    }
    async fn prefetch(&self, keys: &[Key]) {
        match self {
            Backend::Etcd(d) => Box::pin(d.prefetch_keys(keys)).await,
            Backend::Kubernetes(d) => Box::pin(d.prefetch_keys(keys)).await,
        }
    }
    async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        match self {
            Backend::Etcd(d) => Box::pin(d.list(what)).await,
            Backend::Kubernetes(d) => Box::pin(d.list(what)).await,
        }
    }
    async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
        match self {
            Backend::Etcd(d) => Box::pin(d.create(key, value)).await,
            Backend::Kubernetes(d) => Box::pin(d.create(key, value)).await,
        }
    }
    async fn update(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        match self {
            Backend::Etcd(d) => Box::pin(d.update(key, value, revision)).await,
            Backend::Kubernetes(d) => Box::pin(d.update(key, value, revision)).await,
        }
    }
    async fn label_host_affinities(&self, node: &str) -> Result<usize, DatastoreError> {
        match self {
            Backend::Etcd(d) => d.label_host_affinities(node).await,
            Backend::Kubernetes(d) => Box::pin(d.label_host_affinities(node)).await,
        }
    }
    async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError> {
        match self {
            Backend::Etcd(d) => Box::pin(d.delete(key, revision)).await,
            Backend::Kubernetes(d) => Box::pin(d.delete(key, revision)).await,
        }
    }
    async fn create_and_update(
        &self,
        create: (&Key, &Value),
        update: (&Key, &Value, &str),
    ) -> Option<Result<Revision, DatastoreError>> {
        match self {
            Backend::Etcd(d) => Box::pin(d.create_and_update(create, update)).await,
            Backend::Kubernetes(d) => Box::pin(d.create_and_update(create, update)).await,
        }
    }
}
