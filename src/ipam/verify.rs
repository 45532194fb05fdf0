//! CHECK for Calico IPAM: the handle `<network>.<containerID>` exists and each address of the
//! previous result is allocated in its block to that handle. Read-only.

use std::net::IpAddr;

use crate::datastore::model::{AllocationBlock, IpamHandle};
use crate::datastore::{Datastore, Key};
use crate::support::net::IpNet;

/// Why the datastore does not hold what the previous result says.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("IPAM handle {0} does not exist")]
    NoHandle(String),
    #[error("address {ip} is not held by IPAM handle {handle}")]
    NotHeld { ip: IpAddr, handle: String },
    #[error("address {ip} is not allocated in block {block}")]
    NotAllocated { ip: IpAddr, block: IpNet },
    #[error("address {ip} in block {block} belongs to {owner:?}, not to IPAM handle {handle}")]
    OtherOwner {
        ip: IpAddr,
        block: IpNet,
        owner: String,
        handle: String,
    },
    #[error("{0}")]
    Datastore(#[from] crate::datastore::DatastoreError),
    #[error("cannot decode {what}: {why}")]
    Decode { what: String, why: String },
}

impl VerifyError {
    /// The call's deadline, when a datastore read ran out of it.
    pub fn deadline(&self) -> Option<&crate::support::deadline::Expired> {
        match self {
            VerifyError::Datastore(e) => e.deadline(),
            _ => None,
        }
    }
}

/// Verifies that `handle_id` holds every address of `ips`.
pub async fn handle_holds<D: Datastore>(
    ds: &D,
    handle_id: &str,
    ips: &[IpAddr],
) -> Result<(), VerifyError> {
    let key = Key::Handle {
        id: handle_id.to_string(),
    };
    let kv = match ds.get(&key).await {
        Ok(kv) => kv,
        Err(e) if e.is_not_found() => return Err(VerifyError::NoHandle(handle_id.into())),
        Err(e) => return Err(e.into()),
    };
    let handle: IpamHandle = decode(kv.value, &key)?;
    if handle.deleted {
        return Err(VerifyError::NoHandle(handle_id.into()));
    }
    let blocks: Vec<IpNet> = handle
        .block
        .iter()
        .filter(|(_, n)| **n > 0)
        .filter_map(|(cidr, _)| cidr.parse().ok())
        .collect();
    for ip in ips {
        let Some(cidr) = blocks.iter().find(|b| b.contains(ip)) else {
            return Err(VerifyError::NotHeld {
                ip: *ip,
                handle: handle_id.into(),
            });
        };
        let key = Key::Block { cidr: *cidr };
        let block: AllocationBlock = decode(ds.get(&key).await?.value, &key)?;
        let attr = block
            .ordinal_of(ip)
            .and_then(|o| block.allocations.get(o).copied().flatten());
        let Some(attr) = attr else {
            return Err(VerifyError::NotAllocated {
                ip: *ip,
                block: *cidr,
            });
        };
        let owner = block
            .attributes
            .as_deref()
            .and_then(|a| a.get(attr))
            .and_then(|a| a.handle_id.clone())
            .unwrap_or_default();
        if owner != handle_id {
            return Err(VerifyError::OtherOwner {
                ip: *ip,
                block: *cidr,
                owner,
                handle: handle_id.into(),
            });
        }
    }
    Ok(())
}

fn decode<T: serde::de::DeserializeOwned>(
    v: serde_json::Value,
    key: &Key,
) -> Result<T, VerifyError> {
    serde_json::from_value(v).map_err(|e| VerifyError::Decode {
        what: key.describe(),
        why: e.to_string(),
    })
}
