//! The datastore conformance suite (`common::conformance`) against every backend: the
//! in-memory store, a real etcd, and (to come) the Kubernetes backend. Each backend runs the
//! suite twice on one store, which proves the checks clean up after themselves and do not
//! depend on a fresh store; then the store must hold nothing the suite wrote.

mod common;

use std::time::Duration;

use calico_cni::datastore::etcd::{EtcdConfig, EtcdDatastore};
use calico_cni::datastore::memory::MemoryDatastore;
use common::conformance;
use common::etcd::EtcdServer;

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
        let ds = EtcdDatastore::connect(&EtcdConfig {
            endpoints: vec![etcd.endpoint()],
            timeout: Duration::from_secs(5),
            ..Default::default()
        })
        .await
        .unwrap();
        conformance::run_all(&ds).await;
        conformance::run_all(&ds).await;
    });
    assert_eq!(
        etcd.keys("/calico/"),
        Vec::<String>::new(),
        "the suite left keys"
    );
}

// The Kubernetes backend goes here: start the test API server (`common::kube_api`), connect
// the Kubernetes datastore to it, run `conformance::run_all` twice on it, then check that no
// Calico object the suite wrote is left.

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
