//! Releasing addresses and affinities (upstream's `ipam.go` ReleaseIPs, ReleaseByHandle,
//! `releaseBlockAffinity`, `ensureConsistentAffinity`): block writes after a release, the
//! handle bookkeeping that follows, and giving up affinities of blocks whose pool no longer
//! selects their node.

use std::collections::BTreeMap;
use std::net::IpAddr;

use futures::future::join_all;

use tracing::{debug, info, warn};

use super::pools::{in_pools, pool_of, selector_needs_labels, selects, HostView, UsablePools};
use super::{Ipam, IpamError, DATASTORE_RETRIES};
use crate::datastore::model::{
    AllocationBlock, BlockAffinity, IpPool, IpamHandle, Node, AFFINITY_PENDING_DELETION,
};
use crate::datastore::resources::get_resource;
use crate::datastore::{
    to_value, Datastore, DatastoreError, Key, Kind, KvPair, ListKind, Revision,
};
use crate::ipam::lock::Journal;
use crate::support::net::IpNet;

impl<'a, D: Datastore> Ipam<'a, D> {
    /// Releases every address held by `handle_id`; `NotFound` when there is no such handle.
    pub async fn release_by_handle(&self, handle_id: &str) -> Result<(), IpamError> {
        let kv = self
            .ds
            .get(&Key::Handle {
                id: handle_id.to_string(),
            })
            .await?;
        self.release_read_handle(handle_id, kv).await
    }

    /// `release_by_handle` on the handle as just read (`kv`). While the host's lock is held
    /// with its journal (`keep_journal`: a DEL), the blocks' writes and the handle's delete
    /// go out together (`release_beside_handle_delete`); otherwise each block is released and
    /// then counted off the handle, as upstream.
    pub async fn release_read_handle(&self, handle_id: &str, kv: KvPair) -> Result<(), IpamError> {
        let handle: IpamHandle = kv.decode()?;
        let blocks: Vec<IpNet> = handle
            .block
            .keys()
            .filter_map(|cidr_s| match cidr_s.parse::<IpNet>() {
                Ok(cidr) => Some(cidr),
                Err(_) => {
                    warn!(block = %cidr_s, "handle names an unparsable block");
                    None
                }
            })
            .collect();
        match self.journal() {
            Some(journal) => {
                self.release_beside_handle_delete(handle_id, kv, blocks, &journal)
                    .await
            }
            None => self.release_then_count_off(handle_id, kv, &blocks).await,
        }
    }

    /// Upstream's order: each block released, then its addresses counted off the handle,
    /// which goes with its last address.
    async fn release_then_count_off(
        &self,
        handle_id: &str,
        kv: KvPair,
        blocks: &[IpNet],
    ) -> Result<(), IpamError> {
        // The handle as just read serves the first decrement (a CAS write: if it moved, the
        // decrement reads it again).
        let mut read = Some(kv);
        let mut deleted = false;
        for &cidr in blocks {
            let (released, emptied) = self.release_handle_in_block(handle_id, cidr, None).await?;
            if released > 0 {
                // The handle's count and (for a block this emptied) the affinity check touch
                // different objects: both at once, one round trip instead of three.
                let (decremented, ()) = tokio::join!(
                    self.decrement_handle(handle_id, cidr, released, read.take()),
                    async {
                        if let Some(block) = &emptied {
                            self.ensure_consistent_affinity(block, None).await;
                        }
                    }
                );
                match decremented {
                    Ok(gone) => deleted |= gone,
                    Err(IpamError::Datastore(e)) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if deleted {
            return Ok(());
        }
        self.remove_handle_left_over(handle_id).await
    }

    /// Every address of the handle is released, yet the handle survived (its count was off:
    /// a crash between writes, a write retried after a lost answer; or it moved under a
    /// delete): unless a block still holds it, it is removed. DEL leaves no handle behind. A
    /// read that fails here fails the release (the DEL is retried): taking it for "no
    /// handle" would end a DEL successfully with the handle still stored.
    async fn remove_handle_left_over(&self, handle_id: &str) -> Result<(), IpamError> {
        let key = Key::Handle {
            id: handle_id.to_string(),
        };
        let kv = match self.ds.get(&key).await {
            Ok(kv) => kv,
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        let left: IpamHandle = kv.decode()?;
        for cidr in left.block.keys().filter_map(|c| c.parse::<IpNet>().ok()) {
            if let Some((b, _)) = self.get_block(cidr).await? {
                if b.holds_handle(handle_id) {
                    return Ok(());
                }
            }
        }
        warn!(
            handle = handle_id,
            "removing a handle whose counts were off"
        );
        match self.ds.delete(&key, Some(&kv.revision)).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_not_found() || e.is_conflict() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// A DEL's release in one round trip: the blocks the handle names (and those the journal
    /// has pending for it) are read — DEL's first round trip already brought them
    /// (`Datastore::prefetch`) — and then their writes, the handle's compare-and-delete at
    /// the revision read and (when a block will be left empty and affine) the pools'
    /// read for its affinity check all go out at once. The journal records the blocks as
    /// pending before any of it is sent: whichever part lands without the other (a failure,
    /// a SIGKILL), the retried DEL finds the rest, by the handle or by the journal, and the
    /// records are settled only once all of it has landed.
    async fn release_beside_handle_delete(
        &self,
        handle_id: &str,
        kv: KvPair,
        mut blocks: Vec<IpNet>,
        journal: &Journal,
    ) -> Result<(), IpamError> {
        for pending in journal.pending_for(handle_id) {
            if !blocks.contains(&pending) {
                blocks.push(pending);
            }
        }
        let reads = join_all(blocks.iter().map(|&cidr| async move {
            let read = self.get_block(cidr).await?;
            Ok::<_, DatastoreError>(self.newer_copy(cidr, read))
        }))
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        if !journal.intend_all(handle_id, &blocks) {
            // Without the record a handle deleted first could lose the way to its addresses.
            return self.release_then_count_off(handle_id, kv, &blocks).await;
        }
        let empties_affine = reads.iter().flatten().any(|(block, _)| {
            let mut after = block.clone();
            after.release_by_handle(handle_id) > 0 && after.is_empty() && after.affinity.is_some()
        });
        let key = Key::Handle {
            id: handle_id.to_string(),
        };
        let (released, deleted, pools) = tokio::join!(
            join_all(blocks.iter().zip(reads).map(|(&cidr, read)| {
                self.release_handle_in_block(handle_id, cidr, Some(read))
            })),
            self.ds.delete(&key, Some(&kv.revision)),
            async {
                match empties_affine {
                    true => Some(self.pools().await),
                    false => None,
                }
            }
        );
        let mut failed = None;
        for outcome in released {
            match outcome {
                Ok((_, Some(emptied))) => {
                    self.ensure_consistent_affinity(&emptied, pools.as_ref())
                        .await
                }
                Ok((_, None)) => {}
                Err(e) => {
                    failed.get_or_insert(e);
                }
            }
        }
        match deleted {
            Ok(()) => {}
            Err(e) if e.is_not_found() => {}
            // It moved since it was read: what is left of it, if no block holds it, goes.
            Err(e) if e.is_conflict() && failed.is_none() => {
                self.remove_handle_left_over(handle_id).await?
            }
            Err(e) => {
                failed.get_or_insert(e.into());
            }
        }
        match failed {
            // The journal keeps the records: the retried DEL releases what is left.
            Some(e) => Err(e),
            None => {
                journal.settle(handle_id);
                Ok(())
            }
        }
    }

    /// Releases what `cidr`'s block holds for `handle_id`, whose handle object may not lead
    /// to it (a block written beside a handle that did not land: `Journal::intend`): how many.
    pub async fn release_in_block(&self, handle_id: &str, cidr: IpNet) -> Result<usize, IpamError> {
        let (n, emptied) = self.release_handle_in_block(handle_id, cidr, None).await?;
        if let Some(block) = &emptied {
            self.ensure_consistent_affinity(block, None).await;
        }
        Ok(n)
    }

    /// Releases the handle's addresses in one block: how many, and the block when the release
    /// left it empty but affine (its affinity is then checked, `ensure_consistent_affinity`).
    /// `first_read`: the block as the caller just read it, for the first attempt.
    async fn release_handle_in_block(
        &self,
        handle_id: &str,
        cidr: IpNet,
        mut first_read: Option<Option<(AllocationBlock, Revision)>>,
    ) -> Result<(usize, Option<AllocationBlock>), IpamError> {
        for attempt in 0..DATASTORE_RETRIES {
            let read = match first_read.take() {
                Some(read) => read,
                None => {
                    let read = self.get_block(cidr).await?;
                    // The first attempt's read may have been made before the host's lock
                    // was taken (DEL's prefetch): the copy a holder wrote since is newer.
                    match attempt {
                        0 => self.newer_copy(cidr, read),
                        _ => read,
                    }
                }
            };
            let Some((mut block, rev)) = read else {
                return Ok((0, None));
            };
            let n = block.release_by_handle(handle_id);
            if n == 0 {
                return Ok((0, None));
            }
            match self.write_released(&mut block, &rev).await {
                Ok(()) => {
                    let emptied = block.is_empty() && block.affinity.is_some();
                    return Ok((n, emptied.then_some(block)));
                }
                Err(e) if e.is_conflict() => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Err(IpamError::MaxRetries)
    }

    /// Writes a block after a release: an empty block without affinity is deleted, anything
    /// else updated (both compare-and-swap).
    async fn write_released(
        &self,
        block: &mut AllocationBlock,
        rev: &str,
    ) -> Result<(), DatastoreError> {
        if block.is_empty() && block.affinity.is_none() {
            self.copy_block(block.cidr, None);
            self.ds
                .delete(&Key::Block { cidr: block.cidr }, Some(rev))
                .await
        } else {
            self.update_block(block, rev).await.map(|_| ())
        }
    }

    /// Releases specific addresses (dual-stack rollback; with `only_handle`, a failed ADD's
    /// own addresses). Returns those not released: not allocated, or (with `only_handle`)
    /// held by another handle.
    pub async fn release_ips(
        &self,
        ips: &[IpAddr],
        only_handle: Option<&str>,
    ) -> Result<Vec<IpAddr>, IpamError> {
        let blocks = self.block_cidrs(None).await?;
        let mut unallocated = Vec::new();
        let mut by_block: BTreeMap<IpNet, Vec<IpAddr>> = BTreeMap::new();
        for ip in ips {
            match blocks.iter().find(|b| b.contains(ip)) {
                Some(b) => by_block.entry(*b).or_default().push(*ip),
                None => unallocated.push(*ip),
            }
        }
        for (cidr, ips) in by_block {
            let mut done = false;
            for _ in 0..DATASTORE_RETRIES {
                let Some((mut block, rev)) = self.get_block(cidr).await? else {
                    unallocated.extend(ips.iter().copied());
                    done = true;
                    break;
                };
                let outcome = block.release_ips(&ips, only_handle);
                if outcome.unallocated.len() == ips.len() {
                    // Nothing of ours in this block: no write.
                    unallocated.extend(outcome.unallocated.iter().copied());
                    done = true;
                    break;
                }
                match self.write_released(&mut block, &rev).await {
                    Ok(()) => {
                        unallocated.extend(outcome.unallocated.iter().copied());
                        for (handle, n) in &outcome.handles {
                            if let Err(e) = self.decrement_handle(handle, cidr, *n, None).await {
                                warn!(handle, error = %e, "failed to decrement handle");
                            }
                        }
                        if block.is_empty() && block.affinity.is_some() {
                            self.ensure_consistent_affinity(&block, None).await;
                        }
                        done = true;
                        break;
                    }
                    Err(e) if e.is_conflict() => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            if !done {
                return Err(IpamError::MaxRetries);
            }
        }
        Ok(unallocated)
    }

    /// Affine blocks outside the pools selecting this node, whose (enabled) pool no longer
    /// selects it, are given up when empty (upstream's `prepareAffinityBlocksForHost`).
    /// A block without an enabled pool, or whose pool's selector does not parse, is kept.
    /// Failures are only logged.
    pub(super) async fn release_deselected_affinities(
        &self,
        view: &HostView,
        version: u8,
        usable: &UsablePools,
    ) {
        for cidr in view.affine.iter().filter(|c| c.version() == version) {
            if in_pools(cidr, &usable.allowed) || in_pools(cidr, &usable.selecting) {
                continue;
            }
            let Some(pool) = pool_of(cidr, &usable.enabled) else {
                continue;
            };
            match selects(&pool.spec.node_selector, &view.labels) {
                Ok(false) => {}
                Ok(true) => continue,
                Err(e) => {
                    warn!(%cidr, error = %e, "Failed to determine if node matches pool, skipping");
                    continue;
                }
            }
            for _ in 0..DATASTORE_RETRIES {
                match self
                    .release_block_affinity("host", &self.host, *cidr, true, None)
                    .await
                {
                    Ok(()) => {
                        info!(%cidr, "Released affine block that no longer selects this host");
                        break;
                    }
                    Err(IpamError::Datastore(e)) if e.is_conflict() => continue,
                    Err(e) => {
                        debug!(%cidr, error = %e, "kept the affinity of a deselected block");
                        break;
                    }
                }
            }
        }
    }

    /// After a release empties a block: if its (enabled) pool no longer selects the affine
    /// node, give the affinity up (upstream's `ensureConsistentAffinity`). A missing Node, a
    /// block outside every enabled pool or a selector that does not parse keeps the affinity.
    /// Failures are only logged.
    /// `pools`: the pools as the caller read them (read here when `None`).
    pub(super) async fn ensure_consistent_affinity(
        &self,
        block: &AllocationBlock,
        pools: Option<&Result<Vec<IpPool>, IpamError>>,
    ) {
        let Some((kind, host)) = block.affinity.as_deref().and_then(parse_affinity) else {
            return;
        };
        // The pools first: a pool whose selector needs no labels (`all()`, empty) selects
        // every node, so its blocks keep their affinity whatever the Node says, or whether it
        // exists (upstream reads the Node first; the outcome is the same, one request less).
        let read;
        let pools = match pools {
            Some(p) => p,
            None => {
                read = self.pools().await;
                &read
            }
        };
        let Ok(pools) = pools else {
            return;
        };
        let enabled: Vec<IpPool> = pools.iter().filter(|p| p.is_enabled()).cloned().collect();
        let Some(pool) = pool_of(&block.cidr, &enabled) else {
            return;
        };
        if !selector_needs_labels(&pool.spec.node_selector) {
            return;
        }
        let node: Result<Node, _> = get_resource(self.ds, Kind::Node, None, host).await;
        let labels = match node {
            Ok(n) => n.metadata.labels.unwrap_or_default(),
            Err(e) => {
                debug!(host, error = %e, "cannot read the affine node; keeping the affinity");
                return;
            }
        };
        if !matches!(selects(&pool.spec.node_selector, &labels), Ok(false)) {
            return;
        }
        match self
            .release_block_affinity(kind, host, block.cidr, true, None)
            .await
        {
            Ok(()) => {
                info!(cidr = %block.cidr, host, "released the affinity of an empty, deselected block")
            }
            Err(e) => {
                debug!(cidr = %block.cidr, error = %e, "kept the affinity of a deselected block")
            }
        }
    }

    /// Releases `host`'s affinity (of type `host` or `virtual`) to `cidr` (optionally only
    /// when the block is empty and its sequence number is unchanged): affinity →
    /// pendingDeletion, block deleted (if empty) or made non-affine, affinity deleted.
    pub async fn release_block_affinity(
        &self,
        affinity_type: &str,
        host: &str,
        cidr: IpNet,
        require_empty: bool,
        required_seq: Option<u64>,
    ) -> Result<(), IpamError> {
        let key = Key::BlockAffinity {
            host: host.to_string(),
            cidr,
            affinity_type: affinity_type.to_string(),
        };
        let aff_kv = self.ds.get(&key).await?;
        let mut aff: BlockAffinity = aff_kv.decode()?;
        let Some((mut block, block_rev)) = self.get_block(cidr).await? else {
            self.ds.delete(&key, Some(&aff_kv.revision)).await.ok();
            return Ok(());
        };
        if required_seq.is_some_and(|s| s != block.sequence_number) {
            return Err(IpamError::AffinityRelease(format!(
                "block {cidr} sequence number changed"
            )));
        }
        let expected = format!("{affinity_type}:{host}");
        if block.affinity.as_deref().is_some_and(|a| a != expected) {
            self.ds.delete(&key, Some(&aff_kv.revision)).await.ok();
            return Err(IpamError::AffinityRelease(format!(
                "block {cidr} is claimed by another host"
            )));
        }
        if require_empty && !block.is_empty() {
            return Err(IpamError::AffinityRelease(format!(
                "block {cidr} is not empty"
            )));
        }
        aff.state = AFFINITY_PENDING_DELETION.into();
        let aff_rev = self
            .ds
            .update(&key, &to_value(&aff)?, &aff_kv.revision)
            .await?;
        if block.is_empty() {
            self.copy_block(cidr, None);
            match self.ds.delete(&Key::Block { cidr }, Some(&block_rev)).await {
                Ok(()) => {}
                Err(e) if e.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        } else {
            block.affinity = None;
            block.affinity_claim_time = None;
            self.update_block(&mut block, &block_rev).await?;
        }
        match self.ds.delete(&key, Some(&aff_rev)).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_not_found() => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The CIDRs of all existing blocks (of one IP version).
    pub(super) async fn block_cidrs(&self, version: Option<u8>) -> Result<Vec<IpNet>, IpamError> {
        Ok(self
            .ds
            .list(&ListKind::Blocks { version })
            .await?
            .into_iter()
            .filter_map(|kv| match kv.key {
                Key::Block { cidr } => Some(cidr),
                _ => None,
            })
            .collect())
    }
}

/// A block's `affinity` (`host:node1`, `virtual:load-balancer`) as (type, host); anything
/// else (no affinity, an unknown type) names no owner.
pub(super) fn parse_affinity(a: &str) -> Option<(&'static str, &str)> {
    for kind in ["host", "virtual"] {
        if let Some(host) = a.strip_prefix(kind).and_then(|r| r.strip_prefix(':')) {
            return Some((kind, host));
        }
    }
    None
}
