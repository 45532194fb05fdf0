//! IPAM handles (upstream's `ipam_handle.go`): per handle, how many addresses it holds in
//! each block; incremented before a block write, decremented after a release, deleted when
//! nothing is left.

use tracing::{debug, warn};

use super::{Ipam, IpamError, Landed, DATASTORE_RETRIES};
use crate::datastore::model::IpamHandle;
use crate::datastore::{to_value, Datastore, DatastoreError, Key, KvPair};
use crate::support::net::IpNet;

impl<'a, D: Datastore> Ipam<'a, D> {
    /// Adds `n` addresses in `cidr` to the handle's count. `exists`: the handle was just
    /// found to exist, so the first attempt reads it instead of trying to create it. With
    /// `max`, a handle that would then hold more than `max` addresses of `cidr`'s IP
    /// version is left as it is (`MaxAllocReached`): the compare-and-swap on the handle
    /// makes concurrent callers for one handle agree on who got the address.
    pub(super) async fn increment_handle(
        &self,
        id: &str,
        cidr: IpNet,
        n: usize,
        exists: bool,
        max: Option<usize>,
    ) -> Result<(), IpamError> {
        let key = Key::Handle { id: id.to_string() };
        // Most handles are new: try the create first (one round trip), else read-modify-write.
        let mut fresh = IpamHandle::default();
        fresh.block.insert(cidr.to_string(), n as i64);
        let created = match exists {
            true => Err(DatastoreError::AlreadyExists(key.describe())),
            false => self.ds.create(&key, &to_value(&fresh)?).await,
        };
        match created {
            Ok(_) => return Ok(()),
            Err(e) if e.is_already_exists() => {}
            // The create may have been applied and only its answer lost: re-read before the
            // read-modify-write below, which would otherwise count the addresses twice.
            Err(e) => match self.handle_write_landed(&key, &fresh, None).await {
                Landed::Yes => return Ok(()),
                Landed::No => {
                    debug!(handle = id, error = %e, "handle create failed; retrying as update")
                }
                Landed::Unknown(_) => return Err(e.into()),
            },
        }
        let mut last = None;
        for _ in 0..DATASTORE_RETRIES {
            let (mut handle, rev) = match self.ds.get(&key).await {
                Ok(kv) => (kv.decode::<IpamHandle>()?, Some(kv.revision)),
                Err(e) if e.is_not_found() => (IpamHandle::default(), None),
                Err(e) => {
                    last = Some(e);
                    continue;
                }
            };
            if let Some(max) = max {
                let have = same_version_count(&handle, cidr);
                if have + n as i64 > max as i64 {
                    return Err(IpamError::MaxAllocReached {
                        handle: id.to_string(),
                        have,
                        max,
                    });
                }
            }
            *handle.block.entry(cidr.to_string()).or_insert(0) += n as i64;
            let v = to_value(&handle)?;
            let r = match &rev {
                Some(rev) => self.ds.update(&key, &v, rev).await,
                None => self.ds.create(&key, &v).await,
            };
            match r {
                Ok(_) => return Ok(()),
                Err(e) if e.is_conflict() || e.is_already_exists() => last = Some(e),
                // As above: a lost answer must not make the retry count the addresses again.
                Err(e) => match self
                    .handle_write_landed(&key, &handle, rev.as_deref())
                    .await
                {
                    Landed::Yes => return Ok(()),
                    Landed::No => last = Some(e),
                    Landed::Unknown(_) => return Err(e.into()),
                },
            }
        }
        Err(last.map(IpamError::from).unwrap_or(IpamError::MaxRetries))
    }

    /// After a handle write failed with anything but a conflict: whether it was applied all
    /// the same — the handle as stored counts what we wrote, at another revision than the
    /// one we wrote over (`None`: we created it). A handle belongs to one container, so no
    /// other writer makes the same counts meanwhile.
    pub(super) async fn handle_write_landed(
        &self,
        key: &Key,
        written: &IpamHandle,
        over: Option<&str>,
    ) -> Landed {
        match self.ds.get(key).await {
            Ok(kv) => match kv.decode::<IpamHandle>() {
                Ok(h) if h.block == written.block && Some(kv.revision.as_str()) != over => {
                    Landed::Yes
                }
                Ok(_) => Landed::No,
                Err(e) => Landed::Unknown(e),
            },
            Err(e) if e.is_not_found() => Landed::No,
            Err(e) => Landed::Unknown(e),
        }
    }

    /// Takes `n` from the handle's count for `cidr`, deleting the handle when nothing is
    /// left (true then). `read` is the handle as just read, used for the first attempt.
    pub(super) async fn decrement_handle(
        &self,
        id: &str,
        cidr: IpNet,
        n: usize,
        mut read: Option<KvPair>,
    ) -> Result<bool, IpamError> {
        let key = Key::Handle { id: id.to_string() };
        for _ in 0..DATASTORE_RETRIES {
            let kv = match read.take() {
                Some(kv) => kv,
                None => self.ds.get(&key).await?,
            };
            let mut handle: IpamHandle = kv.decode()?;
            let k = cidr.to_string();
            let left = handle.block.get(&k).copied().unwrap_or(0) - n as i64;
            if left < 0 {
                // The blocks are the truth; a count that fell behind (a write retried after a
                // lost answer) must not make a release fail. Upstream errors here.
                warn!(handle = id, block = %cidr, "handle count was lower than its allocations");
            }
            if left <= 0 {
                handle.block.remove(&k);
            } else {
                handle.block.insert(k, left);
            }
            let emptied = handle.block.is_empty();
            let r = if emptied {
                self.ds.delete(&key, Some(&kv.revision)).await
            } else {
                self.ds
                    .update(&key, &to_value(&handle)?, &kv.revision)
                    .await
                    .map(|_| ())
            };
            match r {
                Ok(()) => return Ok(emptied),
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IpamError::MaxRetries)
    }
}

/// How many addresses of `cidr`'s IP version the handle counts.
fn same_version_count(handle: &IpamHandle, cidr: IpNet) -> i64 {
    let v6 = cidr.version() == 6;
    handle
        .block
        .iter()
        .filter(|(block, _)| block.contains(':') == v6)
        .map(|(_, n)| *n)
        .sum()
}
