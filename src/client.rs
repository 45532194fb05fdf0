//! Builds the datastore client from a NetConf (libcalico-go's `CreateClient`): the settings
//! are resolved as upstream does (`datastore::settings`), etcd endpoints come from the
//! settings or from DNS SRV discovery; the Kubernetes backend plugs in here later.

use std::time::Duration;

use crate::config::NetConf;
use crate::datastore::etcd::{EtcdConfig, EtcdDatastore};
use crate::datastore::settings::DatastoreSettings;
use crate::datastore::srv;
use crate::error::{Error, Result};

/// Per-request (and connect) timeout: a dead datastore fails a call instead of hanging it.
pub const DATASTORE_TIMEOUT: Duration = Duration::from_secs(5);

/// Connects to the datastore the NetConf and the environment name. Errors are upstream's
/// bare texts (`calico` ADD prefixes them with `error creating calico client: `).
pub async fn connect(conf: &NetConf) -> Result<EtcdDatastore> {
    conf.validate_name()?;
    let s = DatastoreSettings::from_process(conf).map_err(|e| Error::msg(e.to_string()))?;
    if s.datastore_type != "etcdv3" {
        return Err(Error::msg(format!(
            "datastore type {:?} is not supported yet (only etcdv3)",
            s.datastore_type
        )));
    }
    let endpoints = etcd_endpoints(&s).await?;
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
    Ok(EtcdDatastore::connect(&cfg).await?)
}

/// The configured endpoints, or those DNS SRV discovery finds (libcalico-go etcdv3.go).
async fn etcd_endpoints(s: &DatastoreSettings) -> Result<Vec<String>> {
    if !s.etcd_discovery_srv.is_empty() && !s.etcd_endpoints.is_empty() {
        return Err(Error::msg("multiple discovery or bootstrap options specified, use either \"etcdEndpoints\" or \"etcdDiscoverySrv\""));
    }
    let endpoints = if s.etcd_discovery_srv.is_empty() {
        s.etcd_endpoints.clone()
    } else {
        srv::discover_etcd_endpoints(&s.etcd_discovery_srv)
            .await
            .map_err(|e| {
                Error::msg(format!(
                    "failed to discover etcd endpoints through SRV discovery: {e}"
                ))
            })?
    };
    if endpoints.is_empty() {
        return Err(Error::msg("no etcd endpoints specified"));
    }
    Ok(endpoints)
}

/// Runs one plugin call on a fresh current-thread runtime (one short-lived process per call).
pub fn block_on<F: std::future::Future>(f: F) -> std::result::Result<F::Output, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::msg(format!("failed to start the async runtime: {e}")))?;
    Ok(rt.block_on(f))
}
