//! Builds the datastore client from a NetConf (libcalico-go's `CreateClient`): etcd v3 now;
//! the Kubernetes backend plugs in here later.

use std::time::Duration;

use crate::config::NetConf;
use crate::datastore::etcd::{EtcdConfig, EtcdDatastore};
use crate::error::{Error, Result};

/// Per-request (and connect) timeout: a dead datastore fails a call instead of hanging it.
pub const DATASTORE_TIMEOUT: Duration = Duration::from_secs(5);

pub async fn connect(conf: &NetConf) -> Result<EtcdDatastore> {
    let s = conf.datastore_settings();
    match s.datastore_type.as_str() {
        "etcdv3" => {}
        other => {
            return Err(Error::msg(format!(
                "error creating calico client: datastore type {other:?} is not supported yet (only etcdv3)"
            )))
        }
    }
    if !s.etcd_discovery_srv.is_empty() && !s.etcd_endpoints.is_empty() {
        return Err(Error::msg("error creating calico client: multiple discovery or bootstrap options specified, use either \"etcdEndpoints\" or \"etcdDiscoverySrv\""));
    }
    if s.etcd_endpoints.is_empty() {
        return Err(Error::msg(
            "error creating calico client: no etcd endpoints specified",
        ));
    }
    let opt = |v: &str| (!v.is_empty()).then(|| v.to_string());
    let cfg = EtcdConfig {
        endpoints: s.etcd_endpoints.clone(),
        key_file: opt(&s.etcd_key_file),
        cert_file: opt(&s.etcd_cert_file),
        ca_cert_file: opt(&s.etcd_ca_cert_file),
        username: opt(&s.etcd_username),
        password: opt(&s.etcd_password),
        timeout: DATASTORE_TIMEOUT,
    };
    EtcdDatastore::connect(&cfg)
        .await
        .map_err(|e| Error::msg(format!("error creating calico client: {e}")))
}

/// Runs one plugin call on a fresh current-thread runtime (one short-lived process per call).
pub fn block_on<F: std::future::Future>(f: F) -> std::result::Result<F::Output, Error> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::msg(format!("failed to start the async runtime: {e}")))?;
    Ok(rt.block_on(f))
}
