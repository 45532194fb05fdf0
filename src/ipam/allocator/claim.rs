//! The block reader/writer and the block claim protocol (upstream's
//! `ipam_block_reader_writer.go`): reading and compare-and-swapping blocks, finding an
//! affine block with room or claiming a new one (affinity pending → block → confirmed),
//! and the host's random walk over a pool's blocks.

use std::collections::HashMap;

use tracing::{debug, info, warn};

use super::pools::wholly_reserved;
use super::release::parse_affinity;
use super::{Ipam, IpamError, DATASTORE_RETRIES, EMPTY_BLOCK_MIN_RECLAIM_AGE_SECS};
use crate::datastore::model::{
    AllocationBlock, BlockAffinity, IpPool, IpamConfig, AFFINITY_CONFIRMED, AFFINITY_PENDING,
};
use serde_json::Value;

use crate::datastore::{to_value, Datastore, DatastoreError, Key, ListKind, Revision};
use crate::ipam::randwalk::block_generator;
use crate::support::net::IpNet;
use crate::support::timefmt;

/// Internal outcomes of the claim protocol that make the caller pick another block.
pub(super) enum ClaimError {
    Conflict,
    StaleAffinity,
    ClaimConflict,
    Fatal(IpamError),
}

impl From<DatastoreError> for ClaimError {
    fn from(e: DatastoreError) -> Self {
        if e.is_conflict() {
            ClaimError::Conflict
        } else {
            ClaimError::Fatal(e.into())
        }
    }
}

struct BlockInfo {
    num_free: usize,
    affinity: Option<String>,
    empty: bool,
    claim_time: Option<String>,
    seq: u64,
}

/// A block to assign from: its CIDR, whether this call claimed it, and the block as read.
pub(super) type Found = (IpNet, bool, Option<(AllocationBlock, Revision)>);

pub(super) enum FindError {
    NoFreeBlocks,
    Fatal(IpamError),
}

impl<'a, D: Datastore> Ipam<'a, D> {
    pub(super) async fn get_block(
        &self,
        cidr: IpNet,
    ) -> Result<Option<(AllocationBlock, Revision)>, DatastoreError> {
        match self.ds.get(&Key::Block { cidr }).await {
            Ok(kv) => Ok(Some((kv.decode()?, kv.revision))),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// `read` (a block as read, or its absence), or the copy this host's lock holders last
    /// wrote of it (`BlockCopies`) when that copy is the newer: its revision is the higher.
    /// For a read made before the lock was taken, which the holders before this call may
    /// have written past: the copy spares the compare-and-swap that would fail on the read,
    /// and the read and retry after it, all while the host's other calls wait for the lock.
    /// Revisions are compared as numbers (etcd's revisions, which the API server's
    /// resourceVersions are); where one is not a number, or there is no copy, the read is
    /// kept. A wrong choice costs what a stale copy costs anywhere: a failed
    /// compare-and-swap, a read and a retry.
    pub(super) fn newer_copy(
        &self,
        cidr: IpNet,
        read: Option<(AllocationBlock, Revision)>,
    ) -> Option<(AllocationBlock, Revision)> {
        let Some(journal) = self.journal().filter(|_| self.ds.keeps_block_copies()) else {
            return read;
        };
        let Some(copy) = journal.copies().get(cidr) else {
            return read;
        };
        let Ok(copied) = copy.revision.parse::<u64>() else {
            return read;
        };
        // A block not found stays not found: a copy outliving its block (deleted by another
        // host or Calico's garbage collection) would fail the write instead of a retry.
        let newer = read
            .as_ref()
            .is_some_and(|(_, rev)| rev.parse::<u64>().is_ok_and(|r| copied > r));
        if !newer {
            return read;
        }
        match serde_json::from_str::<AllocationBlock>(&copy.block) {
            Ok(block) => {
                debug!(%cidr, revision = %copy.revision, "the block as this host last wrote it, newer than its read");
                Some((block, copy.revision))
            }
            Err(_) => read,
        }
    }

    /// Every block write bumps the sequence number first (invalidating concurrent writers'
    /// view), then compare-and-swaps on the revision.
    pub(super) async fn update_block(
        &self,
        block: &mut AllocationBlock,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        block.bump_sequence();
        let value = to_value(block)?;
        let written = self
            .ds
            .update(&Key::Block { cidr: block.cidr }, &value, revision)
            .await;
        self.copy_block(block.cidr, written.as_ref().ok().map(|rev| (&value, rev)));
        written
    }

    /// Keeps the block as written at a revision for the host's next IPAM lock holder
    /// (`BlockCopies`), or (`None`: a write that failed or may not have landed, a delete)
    /// forgets it. Only while this call holds the lock (`keep_journal`), and where the
    /// datastore keeps copies (`Datastore::keeps_block_copies`).
    pub(super) fn copy_block(&self, cidr: IpNet, written: Option<(&Value, &Revision)>) {
        let Some(journal) = self.journal().filter(|_| self.ds.keeps_block_copies()) else {
            return;
        };
        match written {
            Some((value, rev)) => journal.copies().keep(cidr, rev, value),
            None => journal.copies().forget(cidr),
        }
    }

    /// Finds an affine block with room, or claims a new one. Returns (cidr, newly claimed).
    pub(super) async fn find_or_claim_block(
        &self,
        affine: &mut Vec<IpNet>,
        pools: &[IpPool],
        config: &IpamConfig,
        reserved: &[IpNet],
        allow_new_claim: bool,
    ) -> Result<Found, FindError> {
        // A. Existing affine blocks, in order.
        while !affine.is_empty() {
            let cidr = affine.remove(0);
            if wholly_reserved(&cidr, reserved) {
                continue;
            }
            if let Some(found) = self.affine_block_with_room(cidr, reserved).await? {
                return Ok(found);
            }
        }
        // B. Claim a new block.
        if !allow_new_claim {
            return Err(FindError::Fatal(IpamError::BlockLimit));
        }
        if !config.auto_allocate_blocks {
            return Err(FindError::Fatal(IpamError::AutoAllocateDisabled));
        }
        self.claim_block_with_room(pools, reserved).await
    }

    /// The affine block `cidr`, when its affinity still stands and it has a free address.
    async fn affine_block_with_room(
        &self,
        cidr: IpNet,
        reserved: &[IpNet],
    ) -> Result<Option<Found>, FindError> {
        for _ in 0..DATASTORE_RETRIES {
            // The affinity (as listed, the first time) and its block (as read on the
            // lock file's hint, the first time) in one round trip.
            let key = Key::host_affinity(&self.host, cidr);
            let listed = self
                .listed_affinities
                .lock()
                .ok()
                .and_then(|mut l| l.remove(&cidr));
            let early = self
                .prefetched_blocks
                .lock()
                .ok()
                .and_then(|mut b| b.remove(&cidr));
            let (aff, block) = tokio::join!(
                async {
                    match listed {
                        Some(kv) => Ok(kv),
                        None => self.ds.get(&key).await,
                    }
                },
                async {
                    match early {
                        Some(b) => Ok(Some(b)),
                        None => self.get_block(cidr).await,
                    }
                }
            );
            let aff = match aff {
                Ok(kv) => kv,
                Err(e) => {
                    debug!(%cidr, error = %e, "affinity vanished");
                    return Ok(None);
                }
            };
            let block = block.map_err(|e| FindError::Fatal(e.into()))?;
            let state: BlockAffinity = aff.decode().map_err(|e| FindError::Fatal(e.into()))?;
            match self
                .block_from_affinity(cidr, state, aff.revision, Some(block))
                .await
            {
                Ok((block, rev)) => {
                    if block.num_free(reserved) >= 1 {
                        return Ok(Some((cidr, false, Some((block, rev)))));
                    }
                    return Ok(None);
                }
                Err(ClaimError::Conflict) => continue,
                Err(ClaimError::StaleAffinity) | Err(ClaimError::ClaimConflict) => return Ok(None),
                Err(ClaimError::Fatal(e)) => {
                    warn!(%cidr, error = %e, "error using affine block");
                    return Ok(None);
                }
            }
        }
        Ok(None)
    }

    /// A new block claimed for this host (pending affinity, then the block, then confirmed)
    /// with a free address.
    async fn claim_block_with_room(
        &self,
        pools: &[IpPool],
        reserved: &[IpNet],
    ) -> Result<Found, FindError> {
        for _ in 0..DATASTORE_RETRIES {
            let cidr = self.find_usable_block(pools, reserved).await?;
            debug!(%cidr, "claiming block");
            for _ in 0..DATASTORE_RETRIES {
                let (aff, rev) = match self.pending_affinity(cidr).await {
                    Ok(a) => a,
                    Err(ClaimError::Conflict) => continue,
                    Err(ClaimError::Fatal(e)) => return Err(FindError::Fatal(e)),
                    Err(_) => break,
                };
                match self.block_from_affinity(cidr, aff, rev, None).await {
                    Ok((block, brev)) => {
                        if block.num_free(reserved) >= 1 {
                            return Ok((cidr, true, Some((block, brev))));
                        }
                        // Filled meanwhile (other hosts borrow from it). Upstream fails the
                        // call here; we look for another block instead.
                        debug!(%cidr, "block filled up while we claimed it");
                        break;
                    }
                    Err(ClaimError::Conflict) => continue,
                    Err(ClaimError::StaleAffinity) | Err(ClaimError::ClaimConflict) => break,
                    Err(ClaimError::Fatal(e)) => return Err(FindError::Fatal(e)),
                }
            }
        }
        Err(FindError::Fatal(IpamError::MaxRetries))
    }

    /// The claim protocol's middle step: make sure the block behind an affinity exists and
    /// is ours, and that the affinity ends up confirmed.
    async fn block_from_affinity(
        &self,
        cidr: IpNet,
        mut aff: BlockAffinity,
        aff_rev: Revision,
        prefetched: Option<Option<(AllocationBlock, Revision)>>,
    ) -> Result<(AllocationBlock, Revision), ClaimError> {
        let key = Key::host_affinity(&self.host, cidr);
        let block = match prefetched {
            Some(b) => b,
            None => self.get_block(cidr).await?,
        };
        match block {
            None => {
                aff.state = AFFINITY_PENDING.into();
                let rev = self.ds.update(&key, &to_value(&aff)?, &aff_rev).await?;
                self.claim_affine_block(cidr, aff, rev).await
            }
            Some((mut block, block_rev)) => {
                if block.affinity.as_deref() != Some(self.host_affinity().as_str()) {
                    info!(%cidr, affinity = ?block.affinity, "deleting stale affinity");
                    self.ds.delete(&key, Some(&aff_rev)).await?;
                    return Err(ClaimError::StaleAffinity);
                }
                let mut block_rev = block_rev;
                if !aff.is_confirmed() {
                    aff.state = AFFINITY_PENDING.into();
                    let rev = self.ds.update(&key, &to_value(&aff)?, &aff_rev).await?;
                    block_rev = self.update_block(&mut block, &block_rev).await?;
                    aff.state = AFFINITY_CONFIRMED.into();
                    self.ds.update(&key, &to_value(&aff)?, &rev).await?;
                }
                Ok((block, block_rev))
            }
        }
    }

    /// Create the affinity as `pending`, or take over an existing unconfirmed one.
    pub(super) async fn pending_affinity(
        &self,
        cidr: IpNet,
    ) -> Result<(BlockAffinity, Revision), ClaimError> {
        let key = Key::host_affinity(&self.host, cidr);
        let aff = BlockAffinity::with_state(AFFINITY_PENDING);
        match self.ds.create(&key, &to_value(&aff)?).await {
            Ok(rev) => Ok((aff, rev)),
            Err(e) if e.is_already_exists() => {
                let kv = self.ds.get(&key).await?;
                let mut existing: BlockAffinity = kv.decode()?;
                if existing.state != AFFINITY_CONFIRMED {
                    existing.state = AFFINITY_PENDING.into();
                    let rev = self
                        .ds
                        .update(&key, &to_value(&existing)?, &kv.revision)
                        .await?;
                    return Ok((existing, rev));
                }
                Ok((existing, kv.revision))
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(super) async fn claim_affine_block(
        &self,
        cidr: IpNet,
        aff: BlockAffinity,
        aff_rev: Revision,
    ) -> Result<(AllocationBlock, Revision), ClaimError> {
        let (now_s, _) = timefmt::now();
        let block = AllocationBlock::new_block(
            cidr,
            Some(&self.host),
            timefmt::now_unix_nanos(),
            Some(timefmt::rfc3339(now_s)),
        );
        match self
            .ds
            .create(&Key::Block { cidr }, &to_value(&block)?)
            .await
        {
            Ok(rev) => {
                self.confirm_affinity(cidr, aff, aff_rev).await?;
                info!(%cidr, host = %self.host, "claimed block");
                Ok((block, rev))
            }
            Err(e) if e.is_already_exists() => {
                let Some((existing, rev)) = self.get_block(cidr).await? else {
                    return Err(ClaimError::Conflict);
                };
                if existing.affinity.as_deref() == Some(self.host_affinity().as_str()) {
                    self.confirm_affinity(cidr, aff, aff_rev).await?;
                    return Ok((existing, rev));
                }
                let key = Key::host_affinity(&self.host, cidr);
                if let Err(e) = self.ds.delete(&key, Some(&aff_rev)).await {
                    debug!(%cidr, error = %e, "could not delete our pending affinity");
                }
                Err(ClaimError::ClaimConflict)
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn confirm_affinity(
        &self,
        cidr: IpNet,
        mut aff: BlockAffinity,
        aff_rev: Revision,
    ) -> Result<(), ClaimError> {
        let key = Key::host_affinity(&self.host, cidr);
        aff.state = AFFINITY_CONFIRMED.into();
        match self.ds.update(&key, &to_value(&aff)?, &aff_rev).await {
            Ok(_) => Ok(()),
            Err(e) => {
                let kv = self.ds.get(&key).await?;
                let now: BlockAffinity = kv.decode()?;
                if now.state == AFFINITY_CONFIRMED {
                    Ok(())
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// A block CIDR to claim: the first in this host's random walk that does not exist yet
    /// (or exists, is ours and has room), else an empty block claimed long enough ago.
    async fn find_usable_block(
        &self,
        pools: &[IpPool],
        reserved: &[IpNet],
    ) -> Result<IpNet, FindError> {
        let index = self.block_index(reserved).await?;
        let mine = self.host_affinity();
        let mut reclaim: Vec<IpNet> = Vec::new();
        for pool in pools {
            let Some(pool_cidr) = pool.cidr() else {
                continue;
            };
            let size = u8::try_from(pool.spec.block_size).unwrap_or(pool_cidr.bits());
            for cidr in block_generator(pool_cidr, size, &self.host) {
                if wholly_reserved(&cidr, reserved) {
                    continue;
                }
                match index.get(&cidr) {
                    None => return Ok(cidr),
                    Some(info)
                        if info.affinity.as_deref() == Some(mine.as_str())
                            && info.num_free != 0 =>
                    {
                        return Ok(cidr)
                    }
                    Some(info) if info.empty && info.num_free != 0 => reclaim.push(cidr),
                    Some(_) => {}
                }
            }
        }
        for cidr in reclaim {
            if let Some(info) = index.get(&cidr) {
                if self.reclaimed(cidr, info).await {
                    return Ok(cidr);
                }
            }
        }
        Err(FindError::NoFreeBlocks)
    }

    /// Every block that exists, by CIDR: what `find_usable_block` asks of each.
    async fn block_index(
        &self,
        reserved: &[IpNet],
    ) -> Result<HashMap<IpNet, BlockInfo>, FindError> {
        let existing = self
            .ds
            .list(&ListKind::Blocks { version: None })
            .await
            .map_err(|e| FindError::Fatal(e.into()))?;
        let mut index: HashMap<IpNet, BlockInfo> = HashMap::new();
        for kv in &existing {
            if let Key::Block { cidr } = kv.key {
                let b: AllocationBlock = kv.decode().map_err(|e| FindError::Fatal(e.into()))?;
                index.insert(
                    cidr,
                    BlockInfo {
                        num_free: b.num_free(reserved),
                        affinity: b.affinity.clone(),
                        empty: b.is_empty(),
                        claim_time: b.affinity_claim_time.clone(),
                        seq: b.sequence_number,
                    },
                );
            }
        }
        Ok(index)
    }

    /// Takes the empty block `cidr` from its owner, when it was claimed long enough ago;
    /// whether it is now free to claim.
    async fn reclaimed(&self, cidr: IpNet, info: &BlockInfo) -> bool {
        let now = timefmt::now().0;
        let old_enough = info
            .claim_time
            .as_deref()
            .and_then(timefmt::parse_rfc3339)
            .is_none_or(|t| now - t >= EMPTY_BLOCK_MIN_RECLAIM_AGE_SECS);
        if !old_enough {
            return false;
        }
        // Only an owned block can be reclaimed (upstream's releaseBlockAffinity refuses an
        // empty host): an empty block without affinity is left to borrowing.
        let Some((kind, owner)) = info.affinity.as_deref().and_then(parse_affinity) else {
            debug!(%cidr, "empty block has no owner to reclaim it from");
            return false;
        };
        match self
            .release_block_affinity(kind, owner, cidr, true, Some(info.seq))
            .await
        {
            Ok(()) => {
                info!(%cidr, "reclaiming empty block");
                true
            }
            Err(e) => {
                debug!(%cidr, error = %e, "could not reclaim empty block");
                false
            }
        }
    }
}

/// Orders blocks of `pool` as `host`'s random walk would visit them: by their distance from
/// the walk's first block, wrapping at the end of the pool.
pub(super) fn sort_in_walk_order(blocks: &mut [IpNet], pool: IpNet, block_size: u8, host: &str) {
    let Some(first) = block_generator(pool, block_size, host).next() else {
        return;
    };
    let shift = u32::from(pool.bits().saturating_sub(block_size));
    let base = crate::support::net::to_u128(pool.masked().addr);
    let index = |c: &IpNet| crate::support::net::to_u128(c.addr).wrapping_sub(base) >> shift;
    let start = index(&first);
    let span = 1u128.checked_shl(u32::from(block_size.saturating_sub(pool.prefix)));
    blocks.sort_by_key(|c| {
        let d = index(c).wrapping_sub(start);
        match span {
            Some(n) => d.rem_euclid(n),
            None => d,
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walk_order_matches_the_generator() {
        for (pool, size) in [("10.0.0.0/24", 28u8), ("fd00::/120", 124)] {
            let pool: IpNet = pool.parse().unwrap();
            let walk: Vec<IpNet> = block_generator(pool, size, "node1").collect();
            let mut some = vec![walk[9], walk[2], walk[15], walk[0], walk[11]];
            sort_in_walk_order(&mut some, pool, size, "node1");
            assert_eq!(some, vec![walk[0], walk[2], walk[9], walk[11], walk[15]]);
        }
    }
}
