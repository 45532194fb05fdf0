//! AutoAssign and AssignIP (upstream's `ipam.go`): the up-front reads, per family the affine
//! blocks (claiming new ones within the per-host limit) then borrowing, assigning from one
//! block with its handle, and assigning one given address.

use std::collections::BTreeMap;
use std::net::IpAddr;

use tracing::{debug, info, warn};

use super::claim::{sort_in_walk_order, ClaimError, FindError};
use super::pools::{wholly_reserved, HostView};
use super::{
    Assignments, AutoAssignArgs, Ipam, IpamError, Landed, ViewReads, DATASTORE_RETRIES,
    DEFAULT_MAX_BLOCKS_PER_HOST,
};
use crate::datastore::model::{AllocationBlock, IpPool, IpamConfig, IpamHandle};
use crate::datastore::{to_value, Datastore, Key, KvPair, ListKind, Revision};
use crate::ipam::block::BlockError;
use crate::ipam::block_copies::BlockCopy;
use crate::ipam::lock::Journal;
use crate::support::net::IpNet;

/// Why assigning from one block failed.
enum AssignError {
    /// Lost a compare-and-swap: re-read the block and try again.
    Conflict,
    /// Nothing was assigned: upstream logs it and moves on to other blocks.
    Failed(IpamError),
    /// The block write failed and whether it was applied is unknown: the handle is kept (DEL
    /// releases whatever it holds) and the call fails rather than assign more elsewhere.
    Unknown(IpamError),
}

/// What a handle's create and its block's write, sent together, came to.
struct PairOutcome {
    block: Landed,
    handle: HandleNow,
    /// The block write's own error, when it reported one.
    block_error: Option<crate::datastore::DatastoreError>,
}

/// Where a handle stands after it was written beside its block.
enum HandleNow {
    /// It counts this call's addresses in the block.
    Counts,
    /// It existed already (and does not count them).
    Existed,
    /// It was not written.
    Missing,
    /// Its write failed and a re-read could not tell whether it was applied.
    Unknown(IpamError),
}

/// What writing a new handle and its block in one request came to.
enum PairWrite {
    /// The backend writes one key at a time: the caller makes the two writes.
    Unsupported,
    /// The handle exists already: the caller reads and updates its count, then writes the
    /// block.
    HandleExists,
    /// Written, or failed as a block write fails.
    Done(Result<Vec<IpNet>, AssignError>),
}

impl From<IpamError> for AssignError {
    fn from(e: IpamError) -> Self {
        match e {
            IpamError::Datastore(d) if d.is_conflict() => AssignError::Conflict,
            other => AssignError::Failed(other),
        }
    }
}

impl<'a, D: Datastore> Ipam<'a, D> {
    /// Assigns `num4` IPv4 and `num6` IPv6 addresses to `handle_id` (IPv4 first).
    pub async fn auto_assign(
        &self,
        args: &AutoAssignArgs,
    ) -> Result<(Assignments, Assignments), IpamError> {
        let reads = self.read_view(&[], &[]).await;
        self.auto_assign_from(args, reads).await
    }

    /// Every read AutoAssign needs up front, together: one round trip. A caller that holds
    /// the host's IPAM lock may issue it early, with its own reads, and hand the answers to
    /// `auto_assign_from`. `hint`: blocks to read meanwhile (the IPAM lock file's, see
    /// `IpamLock::block_hint`), so that the walk's first block read is already made; those
    /// of them in `copies` (`IpamLock::hinted_copies`) are taken as this host last wrote
    /// them instead of read.
    pub async fn read_view(&self, hint: &[IpNet], copies: &[BlockCopy]) -> ViewReads {
        let (reads, hinted) = tokio::join!(self.unhinted_reads(), self.read_hinted(hint, copies));
        self.with_hinted(reads, hinted, false).await
    }

    /// `read_view` in two steps, for a caller that makes the reads before it takes the
    /// host's IPAM lock, so that the lock is held for the writes only while the host's other
    /// calls wait: every read but the hinted blocks' (`read_view_unlocked`), then, under the
    /// lock, the hinted blocks from `copies` (`complete_view`; one without a copy is read
    /// there, a round trip more). A listing of this host's affinities made before the lock
    /// may be behind a claim the holders made since: it is asked of the store again when it
    /// does not cover the hinted blocks, however it was made.
    pub async fn read_view_unlocked(&self) -> ViewReads {
        self.unhinted_reads().await
    }

    /// `read_view_unlocked`'s reads, completed under the lock (see there).
    pub async fn complete_view(
        &self,
        reads: ViewReads,
        hint: &[IpNet],
        copies: &[BlockCopy],
    ) -> ViewReads {
        let hinted = self.read_hinted(hint, copies).await;
        self.with_hinted(reads, hinted, true).await
    }

    /// All of `read_view` but the hinted blocks.
    async fn unhinted_reads(&self) -> ViewReads {
        // The Node is read whatever the pools' selectors (as upstream: a missing Node fails
        // the assignment on either datastore).
        let all_affinities = self.host_affinities();
        let (config, reserved, labels, pools, affs) = tokio::join!(
            self.stored_config(),
            self.reservations(),
            self.node_labels(),
            self.pools(),
            self.ds.list(&all_affinities),
        );
        ViewReads {
            config,
            reserved,
            labels,
            pools,
            affs,
            hinted: Vec::new(),
        }
    }

    /// The hinted blocks that exist: those in `copies` as this host last wrote them (where
    /// the backend keeps copies), the others read.
    async fn read_hinted(
        &self,
        hint: &[IpNet],
        copies: &[BlockCopy],
    ) -> Vec<(IpNet, (AllocationBlock, Revision))> {
        let copies = if self.ds.keeps_block_copies() {
            copies
        } else {
            &[]
        };
        let hinted = futures::future::join_all(hint.iter().map(|&cidr| async move {
            let copy = copies.iter().find(|c| c.cidr == cidr);
            if let Some(block) = copy.and_then(|c| serde_json::from_str(&c.block).ok()) {
                return copy.map(|c| (cidr, (block, c.revision.clone())));
            }
            match self.get_block(cidr).await {
                Ok(Some(b)) => Some((cidr, b)),
                Ok(None) => None,
                Err(e) => {
                    debug!(%cidr, error = %e, "hinted block not read");
                    None
                }
            }
        }));
        hinted.await.into_iter().flatten().collect()
    }

    /// `reads` with the hinted blocks; their affinities asked of the store again when the
    /// listing may be behind (`doubtful`: from a cache, or made before the lock) and does
    /// not cover the hinted blocks.
    async fn with_hinted(
        &self,
        reads: ViewReads,
        hinted: Vec<(IpNet, (AllocationBlock, Revision))>,
        doubtful: bool,
    ) -> ViewReads {
        let affs = match reads.affs {
            Ok(listed) if !doubtful || self.listing_covers(&listed, &hinted) => Ok(listed),
            _ => {
                debug!("this host's affinities asked of the store: the listing may be behind");
                self.ds.list(&self.host_affinities()).await
            }
        };
        ViewReads {
            affs,
            hinted,
            ..reads
        }
    }

    /// Every affinity of this host.
    fn host_affinities(&self) -> ListKind {
        ListKind::Affinities {
            host: self.host.clone(),
            affinity_type: "host".into(),
            version: None,
        }
    }

    /// Whether a listing of this host's affinities has every block read as affine to it.
    fn listing_covers(
        &self,
        listed: &[KvPair],
        hinted: &[(IpNet, (AllocationBlock, Revision))],
    ) -> bool {
        let mine = self.host_affinity();
        let has = |cidr: &IpNet| {
            listed
                .iter()
                .any(|kv| matches!(&kv.key, Key::BlockAffinity { cidr: c, .. } if c == cidr))
        };
        !listed.is_empty()
            && hinted
                .iter()
                .filter(|(_, (b, _))| b.affinity.as_deref() == Some(mine.as_str()))
                .all(|(cidr, _)| has(cidr))
    }

    /// `auto_assign` on reads already made (`read_view`).
    pub async fn auto_assign_from(
        &self,
        args: &AutoAssignArgs,
        reads: ViewReads,
    ) -> Result<(Assignments, Assignments), IpamError> {
        let ViewReads {
            config,
            reserved,
            labels,
            pools,
            affs,
            hinted,
        } = reads;
        if let Ok(mut early) = self.prefetched_blocks.lock() {
            early.extend(hinted);
        }
        let reserved = reserved?;
        let labels = labels?;
        let pools = pools?;
        let affs = affs?;
        if let Ok(mut listed) = self.listed_affinities.lock() {
            listed.clear();
            for kv in &affs {
                if let Key::BlockAffinity { cidr, .. } = &kv.key {
                    listed.insert(*cidr, kv.clone());
                }
            }
        }
        // Errors in upstream's order: reservations, Node, pools, affinities, config.
        let view = HostView {
            reserved,
            labels,
            pools,
            affine: affs
                .into_iter()
                .filter_map(|kv| match kv.key {
                    Key::BlockAffinity { cidr, .. } => Some(cidr),
                    _ => None,
                })
                .collect(),
        };
        let mut config = config?;
        let v4 = self
            .auto_assign_family(args, 4, args.num4, &args.ipv4_pools, &view, &mut config)
            .await?;
        let v6 = self
            .auto_assign_family(args, 6, args.num6, &args.ipv6_pools, &view, &mut config)
            .await;
        match v6 {
            Ok(v6) => Ok((v4, v6)),
            Err(e) => {
                // Upstream hands the IPv4 addresses back with the error and its plugin leaves
                // them (and the handle) to the runtime's DEL; nothing of a failed call stays.
                self.give_back(&v4.ips, &args.handle_id).await;
                Err(e)
            }
        }
    }

    /// Releases what a failed AutoAssign had assigned to `handle` (its handle goes with its
    /// last address), within the call's clean-up grace; a failure is only logged.
    pub async fn give_back(&self, ips: &[IpNet], handle: &str) {
        if ips.is_empty() {
            return;
        }
        let addrs: Vec<IpAddr> = ips.iter().map(|n| n.addr).collect();
        let undo = crate::support::deadline::cleanup_bound(
            "releasing the addresses of a failed assignment",
            self.release_ips(&addrs, Some(handle)),
        );
        let failed = match undo.await {
            Ok(Ok(_)) => return,
            Ok(Err(e)) => e.to_string(),
            Err(e) => e.to_string(),
        };
        warn!(handle, error = %failed, "failed to release the addresses of a failed assignment");
    }

    async fn auto_assign_family(
        &self,
        args: &AutoAssignArgs,
        version: u8,
        num: usize,
        requested_pools: &[IpNet],
        view: &HostView,
        stored_config: &mut Option<IpamConfig>,
    ) -> Result<Assignments, IpamError> {
        let reserved = &view.reserved[..];
        let mut out = Assignments {
            num_requested: num,
            version,
            ..Default::default()
        };
        if num == 0 {
            return Ok(out);
        }
        let usable =
            self.usable_pools_and_blocks(view, version, requested_pools, &args.namespace_labels)?;
        self.release_deselected_affinities(view, version, &usable)
            .await;
        let (pools, mut affine) = (usable.allowed, usable.affine);
        debug!(?affine, "affine blocks for host");
        // GetIPAMConfig comes after the Node, pool and affinity reads (and creates the
        // default config when there is none), once per call.
        let config = &self.config_or_create(stored_config.take()).await?;
        *stored_config = Some(config.clone());
        // 1. Affine blocks, claiming new ones as allowed.
        self.assign_from_affine_blocks(args, &pools, &mut affine, config, reserved, &mut out)
            .await?;

        // 2. Borrow from any block of the pools when strict affinity is off.
        if out.ips.len() < num && !config.strict_affinity {
            self.borrow(args, version, num, &pools, reserved, &mut out)
                .await?;
            if out.ips.len() < num {
                out.add_msg(&format!(
                    "No IPs available in pools: [{}]",
                    pools
                        .iter()
                        .map(|p| p.spec.cidr.as_str())
                        .collect::<Vec<_>>()
                        .join(" ")
                ));
            }
        }
        Ok(out)
    }

    /// AutoAssign's first step: addresses from the host's affine blocks, in order, claiming
    /// new blocks while the host owns fewer than the most it may; up to what `out` still
    /// lacks.
    async fn assign_from_affine_blocks(
        &self,
        args: &AutoAssignArgs,
        pools: &[IpPool],
        affine: &mut Vec<IpNet>,
        config: &IpamConfig,
        reserved: &[IpNet],
        out: &mut Assignments,
    ) -> Result<(), IpamError> {
        let num = out.num_requested;
        let mut owned = affine.len() as i64;
        let max_blocks = max_blocks(args.max_blocks_per_host, config.max_blocks_per_host);
        while out.ips.len() < num {
            let allow_new_claim = owned < max_blocks;
            let claimed = self
                .find_or_claim_block(affine, pools, config, reserved, allow_new_claim)
                .await;
            let (cidr, newly, first) = match claimed {
                Ok(c) => c,
                Err(FindError::NoFreeBlocks) => {
                    if config.strict_affinity {
                        out.add_msg("No more free affine blocks and strict affinity enabled");
                    }
                    debug!("No more free affine blocks");
                    return Ok(());
                }
                Err(FindError::Fatal(e)) => return Err(e),
            };
            if newly {
                owned += 1;
            }
            let got = self
                .assign_from_block_with_retries(
                    cidr,
                    num - out.ips.len(),
                    args,
                    config.strict_affinity,
                    reserved,
                    first,
                )
                .await?;
            out.ips.extend(got);
        }
        Ok(())
    }

    /// Assign from one block, re-reading it on CAS conflicts.
    async fn assign_from_block_with_retries(
        &self,
        cidr: IpNet,
        num: usize,
        args: &AutoAssignArgs,
        affinity_check: bool,
        reserved: &[IpNet],
        mut first: Option<(AllocationBlock, Revision)>,
    ) -> Result<Vec<IpNet>, IpamError> {
        for _ in 0..DATASTORE_RETRIES {
            // The caller's fresh copy first; after a conflict, re-read.
            let current = match first.take() {
                Some(b) => Some(b),
                None => self.get_block(cidr).await?,
            };
            let Some((block, rev)) = current else {
                return Ok(Vec::new());
            };
            match self
                .assign_from_block(block, rev, num, args, affinity_check, reserved)
                .await
            {
                Ok(ips) => {
                    if !ips.is_empty() {
                        self.note_assigned_block(cidr);
                    }
                    return Ok(ips);
                }
                Err(AssignError::Conflict) => continue,
                Err(AssignError::Failed(e)) => {
                    warn!(%cidr, error = %e, "failed to assign from block");
                    return Ok(Vec::new());
                }
                Err(AssignError::Unknown(e)) => return Err(e),
            }
        }
        Err(IpamError::MaxRetries)
    }

    /// In-memory assignment, then the handle, then the block CAS (handle undone on failure).
    async fn assign_from_block(
        &self,
        mut block: AllocationBlock,
        rev: Revision,
        num: usize,
        args: &AutoAssignArgs,
        affinity_check: bool,
        reserved: &[IpNet],
    ) -> Result<Vec<IpNet>, AssignError> {
        let ips = block
            .auto_assign(
                num,
                &args.handle_id,
                &args.attrs,
                &self.host,
                affinity_check,
                reserved,
            )
            .map_err(IpamError::Block)?;
        if ips.is_empty() {
            return Ok(ips);
        }
        let cidr = block.cidr;
        let exists = match self
            .write_new_handle_with_block(&block, &rev, &ips, args)
            .await
        {
            PairWrite::Done(done) => return done,
            PairWrite::HandleExists => true,
            PairWrite::Unsupported => false,
        };
        // A new handle without a per-version limit (which needs the handle read first), with
        // the lock file's journal recording the block as pending: both writes at once.
        if !exists && args.max_per_version.is_none() {
            let journal = self.journal();
            if let Some(j) = journal.filter(|j| j.intend(&args.handle_id, cidr)) {
                return self
                    .write_handle_beside_block(block, &rev, &ips, args, &j)
                    .await;
            }
        }
        match self
            .increment_handle(
                &args.handle_id,
                cidr,
                ips.len(),
                exists,
                args.max_per_version,
            )
            .await
        {
            Ok(()) => self.write_block_counted(block, &rev, ips, args).await,
            Err(IpamError::MaxAllocReached { .. }) => {
                self.addresses_another_call_got(&args.handle_id, cidr).await
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Another call for the same handle got this IP version's address first: that address
    /// is this call's too (upstream's `handleMaxAllocReached`). Until its block write lands
    /// there is none to return: re-read and try again.
    async fn addresses_another_call_got(
        &self,
        handle_id: &str,
        cidr: IpNet,
    ) -> Result<Vec<IpNet>, AssignError> {
        let theirs: Vec<IpNet> = self
            .ips_by_handle(handle_id)
            .await?
            .into_iter()
            .filter(|ip| ip.version() == cidr.version())
            .collect();
        info!(handle = %handle_id, ?theirs, "the handle already has its addresses");
        if theirs.is_empty() {
            // The other call's block write is on its way: give it a moment rather than
            // spend the retries re-reading before it can land.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            return Err(AssignError::Conflict);
        }
        Ok(theirs)
    }

    /// The block's write, once the handle counts `ips`: a failed write undoes the count,
    /// unless it may have landed.
    async fn write_block_counted(
        &self,
        mut block: AllocationBlock,
        rev: &Revision,
        ips: Vec<IpNet>,
        args: &AutoAssignArgs,
    ) -> Result<Vec<IpNet>, AssignError> {
        let cidr = block.cidr;
        if let Err(e) = self.update_block(&mut block, rev).await {
            // A write that failed with anything but a conflict may have been applied (a lost
            // answer). Undoing the handle and moving on would then leave the handle holding
            // these addresses and the ones assigned next, the caller knowing only the latter:
            // re-read the block first.
            if !e.is_conflict() {
                let assigned: Vec<IpAddr> = ips.iter().map(|n| n.addr).collect();
                match self
                    .block_write_landed(&block, &assigned, &args.handle_id)
                    .await
                {
                    Landed::Yes => {
                        info!(%cidr, error = %e, "block write reported failure but was applied");
                        return Ok(ips);
                    }
                    Landed::No => {}
                    Landed::Unknown(re) => {
                        warn!(%cidr, error = %e, reread = %re, "block write outcome unknown");
                        return Err(AssignError::Unknown(e.into()));
                    }
                }
            }
            if let Err(e2) = self
                .decrement_handle(&args.handle_id, cidr, ips.len(), None)
                .await
            {
                warn!(error = %e2, "failed to undo handle increment");
            }
            return Err(IpamError::from(e).into());
        }
        Ok(ips)
    }

    /// Where the datastore cannot write two objects at once (Kubernetes): the new handle and
    /// the block sent together, one round trip instead of two.
    ///
    /// Ordering. Either write may land without the other: one fails, an answer is lost, or
    /// the process is killed between them. The handle without the block is what upstream's
    /// order (handle, then block) can leave too: the handle counts an address no block holds
    /// for it, and DEL releases by the handle, then deletes it. The block without the handle
    /// holds an address no handle leads to, so before anything is sent the IPAM lock file
    /// records the block as pending for this handle (`Journal::intend`, written before the
    /// requests: a SIGKILL keeps it). A DEL of the handle looks in the blocks pending for it
    /// (`calico::release_container_handles`), and the record is settled only once the handle
    /// counts the addresses, or no block holds them. Whatever point a SIGKILL hits, the DEL
    /// that follows finds the addresses; GC and Calico's IPAM garbage collection find them by
    /// the block's attributes, as always.
    ///
    /// The caller's write beside them (`Ipam::write_beside`: the pod's address annotations)
    /// may land with, without or before either. A pod naming an address its block does not
    /// hold for it is what DEL takes back first (it removes the annotations of its own
    /// container); the caller takes it back itself when this call fails.
    async fn write_handle_beside_block(
        &self,
        mut block: AllocationBlock,
        rev: &str,
        ips: &[IpNet],
        args: &AutoAssignArgs,
        journal: &Journal,
    ) -> Result<Vec<IpNet>, AssignError> {
        let cidr = block.cidr;
        let id = &args.handle_id;
        let key = Key::Handle { id: id.clone() };
        let mut fresh = IpamHandle::default();
        fresh.block.insert(cidr.to_string(), ips.len() as i64);
        let value = to_value(&fresh).map_err(|e| AssignError::Failed(e.into()))?;
        // The caller's write that depends only on these addresses goes with them when they
        // are all the call asked for (one family, one block): it cannot tell otherwise.
        let beside = self
            .beside
            .filter(|_| ips.len() == args.num4 + args.num6)
            .map(|b| b.write(ips));
        let (created, updated, ()) = tokio::join!(
            self.ds.create(&key, &value),
            self.update_block(&mut block, rev),
            async {
                if let Some(write) = beside {
                    write.await;
                }
            }
        );
        let assigned: Vec<IpAddr> = ips.iter().map(|n| n.addr).collect();
        let block_now = match &updated {
            Ok(_) => Landed::Yes,
            Err(e) if e.is_conflict() => Landed::No,
            Err(_) => self.block_write_landed(&block, &assigned, id).await,
        };
        let handle_now = match created {
            Ok(_) => HandleNow::Counts,
            Err(e) if e.is_already_exists() => HandleNow::Existed,
            Err(e) => match self.handle_write_landed(&key, &fresh, None).await {
                Landed::Yes => HandleNow::Counts,
                Landed::No => HandleNow::Missing,
                Landed::Unknown(_) => HandleNow::Unknown(e.into()),
            },
        };
        let pair = PairOutcome {
            block: block_now,
            handle: handle_now,
            block_error: updated.err(),
        };
        self.settle_pair_write(cidr, ips, args, journal, pair).await
    }

    /// After the handle's create and the block's write went together: the handle made to
    /// count what the block holds for it, or nothing of this call's left counted; the
    /// journal's pending record settled once either is sure.
    async fn settle_pair_write(
        &self,
        cidr: IpNet,
        ips: &[IpNet],
        args: &AutoAssignArgs,
        journal: &Journal,
        pair: PairOutcome,
    ) -> Result<Vec<IpNet>, AssignError> {
        let id = &args.handle_id;
        match (pair.block, pair.handle) {
            (Landed::Yes, HandleNow::Counts) => {
                journal.settle(id);
                Ok(ips.to_vec())
            }
            // The block holds the addresses: the handle must count them (until it does, the
            // pending record stays).
            (Landed::Yes, h @ (HandleNow::Existed | HandleNow::Missing)) => {
                let existed = matches!(h, HandleNow::Existed);
                self.increment_handle(id, cidr, ips.len(), existed, None)
                    .await
                    .map_err(AssignError::Unknown)?;
                journal.settle(id);
                Ok(ips.to_vec())
            }
            (Landed::Yes, HandleNow::Unknown(e)) => {
                warn!(%cidr, handle = %id, error = %e, "the block holds the addresses; whether the handle was written is unknown");
                Err(AssignError::Unknown(e))
            }
            // Nothing of this call's is in the block: a handle it created must not count it.
            (Landed::No, h) => {
                if matches!(h, HandleNow::Counts | HandleNow::Unknown(_)) {
                    match self.decrement_handle(id, cidr, ips.len(), None).await {
                        Ok(_) => {}
                        Err(IpamError::Datastore(e)) if e.is_not_found() => {}
                        // Over-counting: DEL releases by the handle and deletes it.
                        Err(e) => {
                            warn!(handle = %id, error = %e, "failed to undo the handle's create")
                        }
                    }
                }
                journal.settle(id);
                Err(match pair.block_error {
                    Some(e) if e.is_conflict() => AssignError::Conflict,
                    Some(e) => AssignError::Failed(e.into()),
                    None => AssignError::Failed(IpamError::BlockWriteNotFound),
                })
            }
            (Landed::Unknown(re), _) => {
                warn!(%cidr, reread = %re, "block write outcome unknown; its pending record stays for DEL");
                Err(AssignError::Unknown(match pair.block_error {
                    Some(e) => e.into(),
                    None => re.into(),
                }))
            }
        }
    }

    /// Where the backend writes two keys at once (etcd): the new handle and the block in one
    /// transaction, both or neither, instead of the handle and then the block (one round
    /// trip and one disk sync less, and no handle to undo when the block write loses; the
    /// store ends as after upstream's two writes).
    async fn write_new_handle_with_block(
        &self,
        block: &AllocationBlock,
        rev: &str,
        ips: &[IpNet],
        args: &AutoAssignArgs,
    ) -> PairWrite {
        let handle_key = Key::Handle {
            id: args.handle_id.clone(),
        };
        let mut handle = IpamHandle::default();
        handle
            .block
            .insert(block.cidr.to_string(), ips.len() as i64);
        // Every block write bumps the sequence number (as `update_block`); on a copy, so the
        // two writes still start from the block as read.
        let mut written = block.clone();
        written.bump_sequence();
        let (handle_value, block_value) = match (to_value(&handle), to_value(&written)) {
            (Ok(h), Ok(b)) => (h, b),
            (Err(e), _) | (_, Err(e)) => {
                return PairWrite::Done(Err(AssignError::Failed(e.into())))
            }
        };
        let block_key = Key::Block { cidr: block.cidr };
        let outcome = self
            .ds
            .create_and_update(
                (&handle_key, &handle_value),
                (&block_key, &block_value, rev),
            )
            .await;
        if outcome.is_some() {
            let landed = outcome.as_ref().and_then(|o| o.as_ref().ok());
            self.copy_block(block.cidr, landed.map(|rev| (&block_value, rev)));
        }
        let e = match outcome {
            None => return PairWrite::Unsupported,
            Some(Ok(_)) => return PairWrite::Done(Ok(ips.to_vec())),
            Some(Err(e)) if e.is_already_exists() => return PairWrite::HandleExists,
            Some(Err(e)) if e.is_conflict() => return PairWrite::Done(Err(AssignError::Conflict)),
            Some(Err(e)) if e.is_not_found() => {
                return PairWrite::Done(Err(AssignError::Failed(e.into())))
            }
            Some(Err(e)) => e,
        };
        // No answer: both writes were applied or neither; the block tells which.
        let assigned: Vec<IpAddr> = ips.iter().map(|n| n.addr).collect();
        PairWrite::Done(
            match self
                .block_write_landed(&written, &assigned, &args.handle_id)
                .await
            {
                Landed::Yes => {
                    info!(cidr = %block.cidr, error = %e, "handle and block write reported failure but was applied");
                    Ok(ips.to_vec())
                }
                Landed::No => Err(AssignError::Failed(e.into())),
                Landed::Unknown(re) => {
                    warn!(cidr = %block.cidr, error = %e, reread = %re, "handle and block write outcome unknown");
                    Err(AssignError::Unknown(e.into()))
                }
            },
        )
    }

    /// After a block write that gave `ips` to `handle_id` failed with anything but a
    /// conflict: whether it was applied all the same. Only that write can have given these
    /// ordinals to this handle with these allocation sequence numbers (any other write from
    /// the same revision loses the compare-and-swap), so writes made since (another host
    /// borrowing from the block) do not hide it.
    async fn block_write_landed(
        &self,
        written: &AllocationBlock,
        ips: &[IpAddr],
        handle_id: &str,
    ) -> Landed {
        let stored = match self.get_block(written.cidr).await {
            Ok(Some((b, _))) => b,
            Ok(None) => return Landed::No,
            Err(e) => return Landed::Unknown(e),
        };
        let seq = |b: &AllocationBlock, o: usize| {
            b.sequence_number_for_allocation
                .as_ref()
                .and_then(|m| m.get(&o.to_string()).copied())
        };
        let ours = |ip: &IpAddr| {
            let Some(o) = written.ordinal_of(ip) else {
                return false;
            };
            let holder = stored
                .allocations
                .get(o)
                .copied()
                .flatten()
                .and_then(|i| stored.attributes.as_ref().and_then(|a| a.get(i)))
                .and_then(|a| a.handle_id.as_deref());
            holder == Some(handle_id)
                && seq(&stored, o).is_some()
                && seq(&stored, o) == seq(written, o)
        };
        if !ips.is_empty() && ips.iter().all(ours) {
            Landed::Yes
        } else {
            Landed::No
        }
    }

    /// Borrow addresses from any existing block of the pools, in this host's walk order.
    async fn borrow(
        &self,
        args: &AutoAssignArgs,
        version: u8,
        num: usize,
        pools: &[IpPool],
        reserved: &[IpNet],
        out: &mut Assignments,
    ) -> Result<(), IpamError> {
        // One list of the existing blocks, visited in this host's walk order (rather than a
        // Get per CIDR of the walk, which for an IPv6 pool would never end).
        let existing = self.block_cidrs(Some(version)).await?;
        for pool in pools {
            let Some(pool_cidr) = pool.cidr() else {
                continue;
            };
            let size = u8::try_from(pool.spec.block_size).unwrap_or(pool_cidr.bits());
            let mut in_pool: Vec<IpNet> = existing
                .iter()
                .filter(|c| pool_cidr.covers(c))
                .copied()
                .collect();
            sort_in_walk_order(&mut in_pool, pool_cidr, size, &self.host);
            for cidr in in_pool {
                if out.ips.len() >= num {
                    break;
                }
                if wholly_reserved(&cidr, reserved) {
                    continue;
                }
                let got = self
                    .assign_from_block_with_retries(
                        cidr,
                        num - out.ips.len(),
                        args,
                        false,
                        reserved,
                        None,
                    )
                    .await?;
                if !got.is_empty() {
                    info!(%cidr, "borrowed addresses from a non-affine block");
                }
                out.ips.extend(got);
            }
            if out.ips.len() >= num {
                break;
            }
        }
        Ok(())
    }

    /// Assigns exactly `ip` to `handle_id` (CNI_ARGS `IP=`); with `max`, at most that many
    /// addresses per IP version on the handle (an address it already holds is success).
    pub async fn assign_ip(
        &self,
        ip: IpAddr,
        handle_id: &str,
        attrs: &BTreeMap<String, String>,
        max: Option<usize>,
    ) -> Result<IpNet, IpamError> {
        let (cidr, config) = self.block_of_requested_ip(ip).await?;
        for _ in 0..DATASTORE_RETRIES {
            let Some((mut block, rev)) = self.get_block(cidr).await? else {
                self.claim_for_requested_ip(cidr).await?;
                continue;
            };
            let held = |b: &AllocationBlock| b.addresses_of(handle_id).iter().any(|n| n.addr == ip);
            match block.assign(ip, handle_id, attrs, &self.host, config.strict_affinity) {
                Ok(()) => {}
                Err(BlockError::AlreadyAssigned(_)) if max.is_some() && held(&block) => {
                    return Ok(IpNet::host(ip))
                }
                Err(BlockError::AlreadyAssigned(_)) => return Err(IpamError::AddressInUse(ip)),
                Err(e) => return Err(IpamError::Block(e)),
            }
            match self.increment_handle(handle_id, cidr, 1, false, max).await {
                Ok(()) => {}
                Err(IpamError::MaxAllocReached { max, .. }) => {
                    return self.requested_ip_if_held(handle_id, ip, max).await
                }
                Err(e) => return Err(e),
            }
            match self.update_block(&mut block, &rev).await {
                Ok(_) => return Ok(IpNet::host(ip)),
                Err(e) => {
                    // A failure other than a conflict may be a lost answer: the address
                    // assigned after all. Undoing the handle then would leak the address (DEL
                    // finds no handle), so re-read the block first; when that fails too, keep
                    // the handle so that DEL releases whatever it holds.
                    if !e.is_conflict() {
                        match self.block_write_landed(&block, &[ip], handle_id).await {
                            Landed::Yes => {
                                info!(%ip, error = %e, "block write reported failure but was applied");
                                return Ok(IpNet::host(ip));
                            }
                            Landed::No => {}
                            Landed::Unknown(re) => {
                                warn!(%ip, error = %e, reread = %re, "block write outcome unknown");
                                return Err(e.into());
                            }
                        }
                    }
                    // Unlike upstream, undo the handle count on every failure, conflicts
                    // included, so a retried assignment never over-counts.
                    self.decrement_handle(handle_id, cidr, 1, None).await?;
                    if !e.is_conflict() {
                        return Err(e.into());
                    }
                }
            }
        }
        Err(IpamError::MaxRetries)
    }

    /// The block a requested address belongs in (its enabled pool's block size) and the
    /// IPAM config. The config is read with the pools (one round trip) but only created once
    /// the address is known to be in an enabled pool, as upstream.
    async fn block_of_requested_ip(&self, ip: IpAddr) -> Result<(IpNet, IpamConfig), IpamError> {
        let (stored, pools) = tokio::join!(self.stored_config(), self.pools());
        let pools = pools?;
        // v3.32.1 assigns an `IP=` address in any enabled pool, whatever its allowedUses.
        let pool = pools
            .iter()
            .filter(|p| p.is_enabled() && p.cidr().is_some_and(|c| c.contains(&ip)))
            .find(|p| {
                p.cidr()
                    .is_some_and(|c| c.version() == IpNet::host(ip).version())
            })
            .ok_or(IpamError::NotInPool)?;
        let config = self.config_or_create(stored?).await?;
        let bits = IpNet::host(ip).bits();
        let size = u8::try_from(pool.spec.block_size).unwrap_or(bits);
        let cidr = IpNet::new(ip, size)
            .ok_or_else(|| IpamError::Other(format!("bad block size {size}")))?
            .masked();
        Ok((cidr, config))
    }

    /// The requested address's block does not exist yet: claim it for this host (pending
    /// affinity, then the block). Losing the claim to another host is no error: the caller
    /// reads the block again.
    async fn claim_for_requested_ip(&self, cidr: IpNet) -> Result<(), IpamError> {
        let (aff, arev) = match self.pending_affinity(cidr).await {
            Ok(a) => a,
            Err(ClaimError::Fatal(e)) => return Err(e),
            Err(_) => return Ok(()),
        };
        match self.claim_affine_block(cidr, aff, arev).await {
            Ok(_)
            | Err(ClaimError::ClaimConflict | ClaimError::Conflict | ClaimError::StaleAffinity) => {
                Ok(())
            }
            Err(ClaimError::Fatal(e)) => Err(e),
        }
    }

    /// The handle already holds its `max` addresses of a version: the requested one is
    /// this call's when it is among them, else refused.
    async fn requested_ip_if_held(
        &self,
        handle_id: &str,
        ip: IpAddr,
        max: usize,
    ) -> Result<IpNet, IpamError> {
        let holds = self.ips_by_handle(handle_id).await?;
        if holds.iter().any(|n| n.addr == ip) {
            return Ok(IpNet::host(ip));
        }
        Err(IpamError::Other(format!(
            "handle {handle_id} already has IP(s) allocated, cannot assign additional IP {ip} (maxAllocPerIPVersion={max})"
        )))
    }
}

fn max_blocks(requested: i64, configured: i64) -> i64 {
    let m = if requested > 0 && configured > 0 {
        requested.min(configured)
    } else if requested > 0 {
        requested
    } else {
        configured
    };
    if m <= 0 {
        DEFAULT_MAX_BLOCKS_PER_HOST
    } else {
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_limits() {
        assert_eq!(max_blocks(0, 0), DEFAULT_MAX_BLOCKS_PER_HOST);
        assert_eq!(max_blocks(0, 3), 3);
        assert_eq!(max_blocks(5, 3), 3);
        assert_eq!(max_blocks(1, 0), 1);
    }
}
