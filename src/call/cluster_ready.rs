//! Calico's readiness, shared by `calico` and `calico-ipam`: the ClusterInformation gate
//! every ADD, DEL and GC passes before writing (`datastoreReady: true`), and STATUS's
//! bounded version of it (CNI 1.1).

use std::time::Duration;

use tracing::info;

use crate::call::client;
use crate::config::NetConf;
use crate::datastore::model::ClusterInformation;
use crate::datastore::resources::get_resource;
use crate::datastore::{Datastore, Kind};
use crate::error::{Context, DatastoreNotReady, Error, Result};

/// STATUS's bound on the whole check, connection included.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// ClusterInformation `default` must say `datastoreReady: true`.
pub async fn check_datastore_ready<D: Datastore>(ds: &D) -> Result<()> {
    let ci: ClusterInformation = get_resource(ds, Kind::ClusterInformation, None, "default")
        .await
        .context("error getting ClusterInformation")?;
    if ci.spec.datastore_ready != Some(true) {
        info!("Upgrade may be in progress, ready flag is not set");
        return Err(DatastoreNotReady.into());
    }
    Ok(())
}

/// Calico's readiness for ADD, as a code-50 error when not ready. `calico` also needs the
/// nodename file calico/node writes (its ADD fails without it); calico-ipam does not.
pub async fn calico_ready(conf: &NetConf, needs_nodename_file: bool) -> Result<()> {
    if needs_nodename_file {
        conf.check_nodename_file()
            .map_err(|e| not_available("the node is not ready", Error::from(e)))?;
    }
    let read = async {
        let ds = client::connect(conf).await?;
        check_datastore_ready(&ds).await
    };
    match tokio::time::timeout(STATUS_TIMEOUT, read).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(not_available("the Calico datastore is not ready", e)),
        Err(_) => Err(Error::NotReady {
            what: format!(
                "the Calico datastore did not answer within {}s",
                STATUS_TIMEOUT.as_secs()
            ),
            source: None,
        }),
    }
}

fn not_available(what: &str, cause: Error) -> Error {
    Error::NotReady {
        what: what.to_string(),
        source: Some(Box::new(cause)),
    }
}
