//! IPAMConfig (upstream's `GetIPAMConfig` in `ipam.go`): the stored config, created with
//! the defaults when there is none.

use tracing::info;

use super::{Ipam, IpamError};
use serde_json::Value;

use crate::datastore::model::{IpamConfig, Resource};
use crate::datastore::resources::get_resource;
use crate::datastore::{to_value, Datastore, Key, Kind};

impl<'a, D: Datastore> Ipam<'a, D> {
    /// The stored IPAMConfig, `None` when there is none yet.
    pub(super) async fn stored_config(&self) -> Result<Option<IpamConfig>, IpamError> {
        match self.ds.get(&Key::IpamConfig).await {
            Ok(kv) => Ok(Some(kv.decode()?)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Whether KubeVirt VMs keep their addresses (`kubeVirtVMAddressPersistence`): on unless
    /// the v3 IPAMConfiguration `default` says exactly `Disabled`; one that cannot be read
    /// counts as on (upstream's `getKubeVirtVMAddressPersistence`, which reads that resource:
    /// on etcd a key of its own, not the allocator's `/calico/ipam/v2/config`).
    pub async fn vm_address_persistence(&self) -> bool {
        let got: Result<Resource<Value>, _> =
            get_resource(self.ds, Kind::IpamConfiguration, None, "default").await;
        match got {
            Ok(r) => r.spec.get("kubeVirtVMAddressPersistence") != Some(&Value::from("Disabled")),
            Err(e) => {
                tracing::debug!(error = %e, "Could not retrieve IPAMConfig, defaulting to VMAddressPersistenceEnabled");
                true
            }
        }
    }

    /// v3.32.1's `GetIPAMConfig`: the stored config; when there is none, the defaults are
    /// created (create-if-absent) and used. Losing that race to another writer re-reads.
    pub(super) async fn config_or_create(
        &self,
        stored: Option<IpamConfig>,
    ) -> Result<IpamConfig, IpamError> {
        if let Some(c) = stored {
            return Ok(c);
        }
        for _ in 0..4 {
            let defaults = IpamConfig::defaults();
            match self
                .ds
                .create(&Key::IpamConfig, &to_value(&defaults)?)
                .await
            {
                Ok(_) => {
                    info!("Created the default IPAM configuration");
                    return Ok(defaults);
                }
                Err(e) if e.is_already_exists() => {
                    if let Some(c) = self.stored_config().await? {
                        return Ok(c);
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(IpamError::ConfigRetries)
    }
}
