//! The datastore conformance suite (`common::conformance`) against every backend: the
//! in-memory store, a real etcd, and the Kubernetes backend (against the test API server,
//! with the v1 CRDs and with the projectcalico.org/v3 group). Each backend runs the
//! suite twice on one store, which proves the checks clean up after themselves and do not
//! depend on a fresh store; then the store must hold nothing the suite wrote.

use std::sync::Arc;
use std::time::Duration;

use crate::common;
use crate::common::conformance;
use crate::common::etcd::EtcdServer;
use crate::common::kube_api::KubeApi;
use calico_cni::datastore::kubernetes::client::{KubeClient, KubeSettings};
use calico_cni::datastore::kubernetes::crd::Group;
use calico_cni::datastore::kubernetes::KubeDatastore;
use calico_cni::datastore::memory::MemoryDatastore;
use calico_cni::datastore::{Datastore, Key, ListKind};
use serde_json::{json, Value};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn memory_store_conforms() {
    let ds = MemoryDatastore::new();
    rt().block_on(async {
        conformance::run_all(&ds).await;
        conformance::run_all(&ds).await;
    });
    let left: Vec<_> = ds.dump().into_iter().map(|kv| kv.key).collect();
    assert!(left.is_empty(), "the suite left {left:?}");
}

#[test]
fn etcd_conforms() {
    let etcd = EtcdServer::start();
    rt().block_on(async {
        let ds = common::etcd::connect(&etcd.endpoint(), Duration::from_secs(5)).await;
        conformance::run_all(&ds).await;
        conformance::run_all(&ds).await;
    });
    assert_eq!(
        etcd.keys("/calico/"),
        Vec::<String>::new(),
        "the suite left keys"
    );
}

/// The Kubernetes backend against the test API server, its CRDs under `group` (None: the
/// default `crd.projectcalico.org/v1`): the suite twice, then no Calico object left.
/// The Kubernetes backend on the test server, through its kubeconfig.
async fn kdd_store(api: &KubeApi, group: Group) -> KubeDatastore {
    let settings = KubeSettings {
        kubeconfig: api.kubeconfig().display().to_string(),
        ..Default::default()
    };
    let client = KubeClient::new(&settings, Duration::from_secs(5))
        .await
        .expect("a client for the test API server");
    KubeDatastore::new(Arc::new(client), group)
}

fn kdd_conforms_with(group: Option<&str>) {
    let api = match group {
        Some(g) => KubeApi::start_with_group(g),
        None => KubeApi::start(),
    };
    let group = group.map(Group::new).unwrap_or_default();
    rt().block_on(async {
        let ds = kdd_store(&api, group.clone()).await;
        conformance::run_all(&ds).await;
        conformance::run_all(&ds).await;
    });
    // Every Calico object went through the group asked for.
    let prefix = format!("/apis/{}/", group.api_version);
    let elsewhere: Vec<String> = api
        .requests()
        .into_iter()
        .filter(|r| r.path.starts_with("/apis/") && !r.path.starts_with(&prefix))
        .map(|r| format!("{} {}", r.method, r.path))
        .collect();
    assert!(elsewhere.is_empty(), "outside {prefix}: {elsewhere:?}");
    let ipam_config = if group.is_v3() {
        "ipamconfigurations"
    } else {
        "ipamconfigs"
    };
    let mut left = Vec::new();
    for plural in [
        "ipamblocks",
        "blockaffinities",
        "ipamhandles",
        ipam_config,
        "ippools",
        "clusterinformations",
        "ipreservations",
    ] {
        for obj in api.list(&group.collection(plural)) {
            left.push(format!("{plural}/{}", obj["metadata"]["name"]));
        }
    }
    assert!(left.is_empty(), "the suite left {left:?}");
}

#[test]
fn kdd_conforms() {
    kdd_conforms_with(None);
}

#[test]
fn kdd_conforms_with_the_v3_api_group() {
    kdd_conforms_with(Some("projectcalico.org/v3"));
}

/// The KDD backend remembers what it last read of each object (to save a read before a soft
/// delete). A delete without revision must still delete when another client wrote the object
/// since; one at the remembered revision must not.
#[test]
fn kdd_delete_after_another_clients_write() {
    let api = KubeApi::start();
    rt().block_on(async {
        let (mine, other) = (
            kdd_store(&api, Group::default()).await,
            kdd_store(&api, Group::default()).await,
        );
        let key = Key::Handle {
            id: "conf-delete-after-other".into(),
        };
        let value = |n: i64| json!({"block": {"10.0.0.0/26": n}, "deleted": false});
        let r1 = mine.create(&key, &value(1)).await.unwrap();
        other.update(&key, &value(2), &r1).await.unwrap();
        let e = mine.delete(&key, Some(&r1)).await.unwrap_err();
        assert!(e.is_conflict(), "{e}");
        mine.delete(&key, None).await.unwrap();
        let e = other.get(&key).await.unwrap_err();
        assert!(e.is_not_found(), "{e}");
    });
    assert!(api
        .list(&Group::default().collection("ipamhandles"))
        .is_empty());
}

/// A backend with one deliberate bug, to prove the suite notices each.
mod broken {
    use calico_cni::datastore::memory::MemoryDatastore;
    use calico_cni::datastore::{Datastore, DatastoreError, Key, KvPair, ListKind, Revision};
    use serde_json::Value;

    #[derive(Clone, Copy, Debug)]
    pub enum Bug {
        /// Updates ignore the revision (no compare-and-swap).
        UpdateIgnoresRevision,
        /// Deleting an absent key succeeds.
        DeleteOfAbsentSucceeds,
        /// Lists of blocks ignore the version.
        BlockListIgnoresVersion,
        /// Blocks lose `affinity_claim_time` on write.
        DropsClaimTime,
        /// Creating an existing key is a conflict.
        CreateSaysConflict,
    }

    pub struct Broken {
        pub inner: MemoryDatastore,
        pub bug: Bug,
    }

    impl Datastore for Broken {
        async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError> {
            self.inner.get(key).await
        }

        async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
            match (self.bug, what) {
                (Bug::BlockListIgnoresVersion, ListKind::Blocks { .. }) => {
                    self.inner.list(&ListKind::Blocks { version: None }).await
                }
                _ => self.inner.list(what).await,
            }
        }

        async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
            let mut v = value.clone();
            if let (Bug::DropsClaimTime, Some(o)) = (self.bug, v.as_object_mut()) {
                o.remove("affinity_claim_time");
            }
            match self.inner.create(key, &v).await {
                Err(DatastoreError::AlreadyExists(k))
                    if matches!(self.bug, Bug::CreateSaysConflict) =>
                {
                    Err(DatastoreError::Conflict(k))
                }
                other => other,
            }
        }

        async fn update(
            &self,
            key: &Key,
            value: &Value,
            revision: &str,
        ) -> Result<Revision, DatastoreError> {
            let revision = match self.bug {
                Bug::UpdateIgnoresRevision => match self.inner.get(key).await {
                    Ok(kv) => kv.revision,
                    Err(_) => revision.to_string(),
                },
                _ => revision.to_string(),
            };
            self.inner.update(key, value, &revision).await
        }

        async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError> {
            match self.inner.delete(key, revision).await {
                Err(e) if e.is_not_found() && matches!(self.bug, Bug::DeleteOfAbsentSucceeds) => {
                    Ok(())
                }
                other => other,
            }
        }
    }
}

#[test]
fn the_suite_notices_a_broken_backend() {
    use broken::{Broken, Bug};
    let cases = [
        (Bug::UpdateIgnoresRevision, "update_compare_and_swap"),
        (Bug::DeleteOfAbsentSucceeds, "delete_semantics"),
        (Bug::BlockListIgnoresVersion, "list_blocks_by_version"),
        (Bug::DropsClaimTime, "ipam_values_round_trip"),
        (Bug::CreateSaysConflict, "create_then_already_exists"),
    ];
    for (bug, check) in cases {
        let ds = Broken {
            inner: MemoryDatastore::new(),
            bug,
        };
        let results = rt().block_on(conformance::run_each(&ds));
        let failed: Vec<&str> = results
            .iter()
            .filter(|(_, r)| r.is_err())
            .map(|(n, _)| *n)
            .collect();
        assert!(
            failed.contains(&check),
            "{bug:?} went unnoticed by {check}: failed {failed:?}"
        );
    }
}

/// The Kubernetes backend's delete at a revision: one DELETE whose preconditions name the
/// revision (and the UID, when known; upstream marks the object deleted first, then deletes
/// it by UID: two round trips, the same outcome); at a stale revision it is a conflict and the object
/// stays. An object left soft-deleted by an upstream client that died between its two
/// requests is NotFound to a Get, which finishes the delete, and is not listed among a
/// host's affinities.
#[test]
fn kdd_compare_and_delete_and_a_leftover_soft_delete() {
    let api = KubeApi::start();
    let group = Group::default();
    rt().block_on(async {
        let ds = kdd_store(&api, group.clone()).await;
        let handle = Key::Handle {
            id: "k8s-pod-network.Soft".into(),
        };
        let value = json!({"block": {"10.0.0.0/26": 1}, "deleted": false});
        let rev = ds.create(&handle, &value).await.unwrap();
        let path = group.object("ipamhandles", "k8s-pod-network.soft");
        // At a stale revision: a conflict, nothing deleted.
        let two = json!({"block": {"10.0.0.0/26": 2}, "deleted": false});
        let newer = ds.update(&handle, &two, &rev).await.unwrap();
        let e = ds.delete(&handle, Some(&rev)).await.unwrap_err();
        assert!(e.is_conflict(), "{e}");
        assert!(api.get(&path).is_some());
        api.clear_requests();
        ds.delete(&handle, Some(&newer)).await.unwrap();
        let reqs = api.requests();
        assert_eq!(
            reqs.iter()
                .map(|r| format!("{} {}", r.method, r.path))
                .collect::<Vec<_>>(),
            vec![format!("DELETE {path}")]
        );
        let del: Value = serde_json::from_str(&reqs[0].body).unwrap();
        // (the UID too when this client knows it: here the conflict made it forget the
        // object; a resourceVersion names one object's one state anyway)
        assert_eq!(del["preconditions"]["resourceVersion"], newer.as_str());
        assert!(api.get(&path).is_none());

        // A leftover: an affinity another client marked deleted and never removed.
        let cidr: calico_cni::support::net::IpNet = "10.1.0.0/26".parse().unwrap();
        let aff = Key::host_affinity("node-x", cidr);
        ds.create(&aff, &json!({"state": "confirmed", "deleted": false}))
            .await
            .unwrap();
        let aff_path = group.object("blockaffinities", "node-x-10-1-0-0-26");
        let mut left = api.get(&aff_path).unwrap();
        left["spec"]["deleted"] = json!("true");
        api.put(&aff_path, left);
        let listed = ds
            .list(&ListKind::Affinities {
                host: "node-x".into(),
                affinity_type: "host".into(),
                version: Some(4),
            })
            .await
            .unwrap();
        assert!(listed.is_empty(), "{listed:?}");
        let e = ds.get(&aff).await.unwrap_err();
        assert!(e.is_not_found(), "{e}");
        assert!(api.get(&aff_path).is_none(), "the Get finished the delete");
    });
}
