//! The Kubernetes core objects the plugins read (Node, Namespace, Pod), by one set of paths,
//! typed, on the client the datastore already holds when it can (`client_for`): the pod and
//! namespace for `policy.type: k8s`, the node's pod CIDRs for host-local's `usePodCidr`, the
//! namespace's labels for IP pools' `namespaceSelector`, and the upgrade's node and pods.

use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use serde::de::DeserializeOwned;

use crate::datastore::kubernetes::client::{ApiResponse, KubeClient};
use crate::datastore::DatastoreError;

pub fn node_path(name: &str) -> String {
    format!("/api/v1/nodes/{name}")
}

pub fn namespace_path(name: &str) -> String {
    format!("/api/v1/namespaces/{name}")
}

pub fn pod_path(namespace: &str, name: &str) -> String {
    format!("/api/v1/namespaces/{namespace}/pods/{name}")
}

/// GETs one object: an answer other than 2xx is the API server's message, as upstream's
/// client-go error prints.
pub async fn get<T: DeserializeOwned>(
    client: &KubeClient,
    path: &str,
) -> Result<T, DatastoreError> {
    answer(path, client.get(path).await?)
}

fn answer<T: DeserializeOwned>(path: &str, resp: ApiResponse) -> Result<T, DatastoreError> {
    if !resp.ok() {
        return Err(DatastoreError::Status(resp.status_object().message));
    }
    decode(path, &resp.body)
}

/// `get`, with a 404 as `None`.
pub async fn get_if_exists<T: DeserializeOwned>(
    client: &KubeClient,
    path: &str,
) -> Result<Option<T>, DatastoreError> {
    let resp = client.get(path).await?;
    match resp.status {
        404 => Ok(None),
        _ if !resp.ok() => Err(DatastoreError::Status(resp.status_object().message)),
        _ => decode(path, &resp.body).map(Some),
    }
}

fn decode<T: DeserializeOwned>(path: &str, body: &[u8]) -> Result<T, DatastoreError> {
    serde_json::from_slice(body).map_err(|e| DatastoreError::InvalidObject {
        path: path.to_string(),
        source: std::sync::Arc::new(e),
    })
}

pub async fn node(client: &KubeClient, name: &str) -> Result<Node, DatastoreError> {
    get(client, &node_path(name)).await
}

pub async fn namespace(client: &KubeClient, name: &str) -> Result<Namespace, DatastoreError> {
    get(client, &namespace_path(name)).await
}

pub async fn pod(client: &KubeClient, namespace: &str, name: &str) -> Result<Pod, DatastoreError> {
    get(client, &pod_path(namespace, name)).await
}
