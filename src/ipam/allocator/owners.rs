//! The owners of a handle's addresses (upstream's `IPsByHandle`, `GetAssignmentAttributes`
//! and `SetOwnerAttributes`): what a KubeVirt VM's persistent handle needs.

use std::net::IpAddr;

use super::{Ipam, IpamError, DATASTORE_RETRIES};
use crate::datastore::model::IpamHandle;
use crate::datastore::{Datastore, Key};
use crate::ipam::owner::{OwnerUpdate, Owners};
use crate::support::net::IpNet;

impl<'a, D: Datastore> Ipam<'a, D> {
    /// The addresses `handle` holds, with their blocks' masks: the handle's blocks read
    /// together, each address in ordinal order. A missing handle is the datastore's
    /// not-found error; a block that cannot be read is skipped (as upstream).
    pub async fn ips_by_handle(&self, handle: &str) -> Result<Vec<IpNet>, IpamError> {
        let key = Key::Handle {
            id: handle.to_string(),
        };
        let stored: IpamHandle = self.ds.get(&key).await?.decode()?;
        let cidrs: Vec<IpNet> = stored.block.keys().filter_map(|c| c.parse().ok()).collect();
        let blocks = futures::future::join_all(cidrs.iter().map(|c| self.get_block(*c))).await;
        let mut out = Vec::new();
        for (cidr, read) in cidrs.iter().zip(blocks) {
            match read {
                Ok(Some((block, _))) => out.extend(block.addresses_of(handle)),
                Ok(None) => {}
                Err(e) => tracing::warn!(%cidr, error = %e, "cannot read a block of the handle"),
            }
        }
        Ok(out)
    }

    /// The owners of `ip` (in block `block`), `None` when it is not allocated.
    pub async fn owners(&self, ip: IpAddr, block: IpNet) -> Result<Option<Owners>, IpamError> {
        Ok(self
            .get_block(block)
            .await?
            .and_then(|(b, _)| b.owners_of(&ip)))
    }

    /// Changes the owners of `ip` (in block `block`, held by `handle`), re-reading the block
    /// when another write moved it.
    pub async fn set_owners(
        &self,
        ip: IpAddr,
        block: IpNet,
        handle: &str,
        update: &OwnerUpdate,
    ) -> Result<(), IpamError> {
        for _ in 0..DATASTORE_RETRIES {
            let Some((mut b, rev)) = self.get_block(block).await? else {
                return Err(IpamError::Owner(
                    crate::ipam::owner::OwnerError::Unassigned(ip),
                ));
            };
            b.set_owners(&ip, handle, update)?;
            match self.update_block(&mut b, &rev).await {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IpamError::MaxRetries)
    }
}
