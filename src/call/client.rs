//! The plugin's way in to the datastore (libcalico-go's `CreateClient`): settings resolved
//! from the NetConf and the environment, then `datastore::backend::connect`.

use crate::config::NetConf;
use crate::datastore::backend::{self, Backend};
use crate::datastore::settings::DatastoreSettings;
use crate::error::{Context, Error, Result};

pub use crate::datastore::backend::DATASTORE_TIMEOUT;

/// Connects to the datastore the NetConf and the environment name. Errors are upstream's
/// bare texts (`calico` ADD prefixes them with `error creating calico client: `).
pub async fn connect(conf: &NetConf) -> Result<Backend> {
    conf.validate_name()?;
    let s = DatastoreSettings::from_process(conf)?;
    Ok(backend::connect(&s).await?)
}

/// `connect` for an ADD: on etcd with policy type k8s, the API server the pod and its
/// namespace are read from is connected to at the same time (its TLS handshake alongside
/// etcd's connection instead of after it, see `backend::connect`).
pub async fn connect_for_add(conf: &NetConf) -> Result<Backend> {
    conf.validate_name()?;
    let mut s = DatastoreSettings::from_process(conf)?;
    if conf.policy.policy_type == "k8s" && s.datastore_type != "kubernetes" {
        s.policy_kube = Some(DatastoreSettings::plugin_kube(conf));
    }
    Ok(backend::connect(&s).await?)
}

/// Runs one plugin call on a fresh current-thread runtime (one short-lived process per call).
/// The call's future (tens of KB: every step's state) goes to the heap, not onto the main
/// thread's stack once more.
pub fn block_on<F: std::future::Future>(f: F) -> std::result::Result<F::Output, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("failed to start the async runtime")?;
    Ok(rt.block_on(Box::pin(f)))
}
