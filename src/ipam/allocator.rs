//! Calico's IPAM allocator over the `Datastore` trait (libcalico-go `lib/ipam`):
//! AutoAssign (affine blocks, the pending → block → confirmed claim protocol, borrowing),
//! AssignIP, ReleaseByHandle and ReleaseIPs. Every write is a compare-and-swap retried a
//! bounded number of times, so concurrent callers on many nodes never hand out an address
//! twice. See calico-datastore.md §3.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use tracing::{debug, info, warn};

use crate::datastore::model::{
    AllocationBlock, BlockAffinity, IpPool, IpReservation, IpamConfig, IpamHandle, Node,
    AFFINITY_CONFIRMED, AFFINITY_PENDING, AFFINITY_PENDING_DELETION,
};
use crate::datastore::resources::{get_resource, list_resources};
use crate::datastore::{
    to_value, Datastore, DatastoreError, Key, Kind, KvPair, ListKind, Revision,
};
use crate::ipam::block::BlockError;
use crate::ipam::randwalk::block_generator;
use crate::ipam::selector;
use crate::net::IpNet;
use crate::timefmt;

/// Upstream's bound on every CAS retry loop.
pub const DATASTORE_RETRIES: usize = 100;
/// Blocks a host may own when neither the request nor IPAMConfig says otherwise.
pub const DEFAULT_MAX_BLOCKS_PER_HOST: i64 = 20;
/// An empty block claimed at least this long ago may be reclaimed by another host.
pub const EMPTY_BLOCK_MIN_RECLAIM_AGE_SECS: i64 = 60;
pub const INTENDED_USE_WORKLOAD: &str = "Workload";

#[derive(Debug, thiserror::Error)]
pub enum IpamError {
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    #[error("cannot find a qualified ippool")]
    NoQualifiedPool,
    #[error("cannot find a qualified ippool, no pools match the required use (Workload)")]
    NoPoolForUse,
    /// An IP pool's nodeSelector or namespaceSelector does not parse (the parser's text).
    #[error("{0}")]
    Selector(String),
    #[error("the given pool ({0}) does not exist, or is not enabled")]
    PoolNotEnabled(String),
    #[error("no configured Calico pools for node {0}")]
    NoPoolsForNode(String),
    #[error("cannot allocate new block due to per host block limit")]
    BlockLimit,
    #[error("failed to find or claim a block")]
    AutoAllocateDisabled,
    #[error("failed to get ipam config after 5 retries")]
    ConfigRetries,
    /// An affinity that must not be released (claimed by another host, not empty, changed).
    #[error("{0}")]
    AffinityRelease(String),
    #[error("Max retries hit - excessive concurrent IPAM requests")]
    MaxRetries,
    #[error("The provided IP address is not in a configured pool\n")]
    NotInPool,
    #[error("resource already exists: {0} with error: Address already assigned in block")]
    AddressInUse(IpAddr),
    #[error("{0}")]
    Block(String),
    /// Reading the Node failed: upstream returns the datastore error as it is.
    #[error(transparent)]
    Node(DatastoreError),
    #[error("{0}")]
    Other(String),
}

/// Internal outcomes of the claim protocol that make the caller pick another block.
enum ClaimError {
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

/// What re-reading an object says about a write that failed with anything but a conflict
/// (a lost answer: a timeout or a dropped connection after the server applied it).
enum Landed {
    Yes,
    No,
    /// The re-read failed too: the write may or may not have been applied.
    Unknown(DatastoreError),
}

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

impl From<IpamError> for AssignError {
    fn from(e: IpamError) -> Self {
        match e {
            IpamError::Datastore(d) if d.is_conflict() => AssignError::Conflict,
            other => AssignError::Failed(other),
        }
    }
}

/// What AutoAssign was asked for.
#[derive(Clone, Debug, Default)]
pub struct AutoAssignArgs {
    pub num4: usize,
    pub num6: usize,
    pub handle_id: String,
    pub attrs: BTreeMap<String, String>,
    pub ipv4_pools: Vec<IpNet>,
    pub ipv6_pools: Vec<IpNet>,
    /// 0 = use IPAMConfig's value (0 there too = 20).
    pub max_blocks_per_host: i64,
    /// The pod's namespace's labels, for pools' `namespaceSelector` (empty without a
    /// Kubernetes client, as upstream's nil Namespace).
    pub namespace_labels: BTreeMap<String, String>,
}

/// The addresses one family got, and why it got fewer than asked (upstream's Msgs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignments {
    pub ips: Vec<IpNet>,
    pub num_requested: usize,
    pub version: u8,
    pub msgs: Vec<String>,
}

impl Assignments {
    /// Upstream's `AddMsg`: each reason once, in order.
    fn add_msg(&mut self, msg: &str) {
        if !self.msgs.iter().any(|m| m == msg) {
            self.msgs.push(msg.to_string());
        }
    }

    /// Upstream's `PartialFulfillmentError` text.
    pub fn shortfall(&self) -> Option<String> {
        (self.ips.len() < self.num_requested).then(|| {
            let mut s = format!(
                "Assigned {} out of {} requested IPv{} addresses",
                self.ips.len(),
                self.num_requested,
                self.version
            );
            for m in &self.msgs {
                s.push_str("; ");
                s.push_str(m);
            }
            s
        })
    }
}

/// The allocator for one host.
pub struct Ipam<'a, D: Datastore> {
    ds: &'a D,
    host: String,
    /// This host's affinities as AutoAssign listed them: the first look at an affine block
    /// uses the listed affinity instead of reading it again (a retry reads it afresh).
    listed_affinities: std::sync::Mutex<HashMap<IpNet, KvPair>>,
}

struct BlockInfo {
    num_free: usize,
    affinity: Option<String>,
    empty: bool,
    claim_time: Option<String>,
    seq: u64,
}

impl<'a, D: Datastore> Ipam<'a, D> {
    pub fn new(ds: &'a D, host: &str) -> Self {
        Ipam {
            ds,
            host: host.to_string(),
            listed_affinities: Default::default(),
        }
    }

    fn host_affinity(&self) -> String {
        format!("host:{}", self.host)
    }

    // ---------------------------------------------------------------- reads

    /// The stored IPAMConfig, `None` when there is none yet.
    async fn stored_config(&self) -> Result<Option<IpamConfig>, IpamError> {
        match self.ds.get(&Key::IpamConfig).await {
            Ok(kv) => Ok(Some(kv.decode()?)),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// v3.32.1's `GetIPAMConfig`: the stored config; when there is none, the defaults are
    /// created (create-if-absent) and used. Losing that race to another writer re-reads.
    async fn config_or_create(&self, stored: Option<IpamConfig>) -> Result<IpamConfig, IpamError> {
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

    async fn reservations(&self) -> Result<Vec<IpNet>, IpamError> {
        let rs: Vec<IpReservation> = list_resources(
            self.ds,
            &ListKind::Resources {
                kind: Kind::IpReservation,
                namespace: None,
                name_prefix: None,
            },
        )
        .await?;
        Ok(rs
            .iter()
            .flat_map(|r| r.spec.reserved_cidrs.iter())
            .filter_map(|c| parse_cidr_or_ip(c))
            .collect())
    }

    /// All pools, with read defaults applied, in name order.
    pub async fn pools(&self) -> Result<Vec<IpPool>, IpamError> {
        Ok(list_resources(
            self.ds,
            &ListKind::Resources {
                kind: Kind::IpPool,
                namespace: None,
                name_prefix: None,
            },
        )
        .await?)
    }

    async fn node_labels(&self) -> Result<BTreeMap<String, String>, IpamError> {
        let node: Node = get_resource(self.ds, Kind::Node, None, &self.host)
            .await
            .map_err(IpamError::Node)?;
        Ok(node.metadata.labels.unwrap_or_default())
    }

    async fn get_block(
        &self,
        cidr: IpNet,
    ) -> Result<Option<(AllocationBlock, Revision)>, DatastoreError> {
        match self.ds.get(&Key::Block { cidr }).await {
            Ok(kv) => Ok(Some((kv.decode()?, kv.revision))),
            Err(e) if e.is_not_found() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Every block write bumps the sequence number first (invalidating concurrent writers'
    /// view), then compare-and-swaps on the revision.
    async fn update_block(
        &self,
        block: &mut AllocationBlock,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        block.bump_sequence();
        self.ds
            .update(
                &Key::Block { cidr: block.cidr },
                &to_value(block)?,
                revision,
            )
            .await
    }

    // ------------------------------------------------------------ AutoAssign

    /// Assigns `num4` IPv4 and `num6` IPv6 addresses to `handle_id` (IPv4 first).
    pub async fn auto_assign(
        &self,
        args: &AutoAssignArgs,
    ) -> Result<(Assignments, Assignments), IpamError> {
        let reads = self.read_view().await;
        self.auto_assign_from(args, reads).await
    }

    /// Every read AutoAssign needs up front, together: one round trip. A caller that holds
    /// the host's IPAM lock may issue it early, with its own reads, and hand the answers to
    /// `auto_assign_from`.
    pub async fn read_view(&self) -> ViewReads {
        let all_affinities = ListKind::Affinities {
            host: self.host.clone(),
            affinity_type: "host".into(),
            version: None,
        };
        // A backend whose nodes always exist (Kubernetes: the kubelet's Node) reads the Node
        // only when a pool's node selector needs its labels.
        let node_up_front = !self.ds.nodes_always_exist();
        let (config, reserved, labels, pools, affs) = tokio::join!(
            self.stored_config(),
            self.reservations(),
            async {
                if node_up_front {
                    self.node_labels().await.map(Some)
                } else {
                    Ok(None)
                }
            },
            self.pools(),
            self.ds.list(&all_affinities)
        );
        ViewReads {
            config,
            reserved,
            labels,
            pools,
            affs,
        }
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
        } = reads;
        let reserved = reserved?;
        let labels = labels?;
        let pools = pools?;
        let affs = affs?;
        let labels = match labels {
            Some(l) => l,
            None if pools
                .iter()
                .any(|p| selector_needs_labels(&p.spec.node_selector)) =>
            {
                self.node_labels().await?
            }
            None => BTreeMap::new(),
        };
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
            .await?;
        Ok((v4, v6))
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
        let mut owned = affine.len() as i64;
        let max_blocks = max_blocks(args.max_blocks_per_host, config.max_blocks_per_host);

        // 1. Affine blocks, claiming new ones as allowed.
        while out.ips.len() < num {
            let allow_new_claim = owned < max_blocks;
            let claimed = self
                .find_or_claim_block(&mut affine, &pools, config, reserved, allow_new_claim)
                .await;
            let (cidr, newly, first) = match claimed {
                Ok(c) => c,
                Err(FindError::NoFreeBlocks) => {
                    if config.strict_affinity {
                        out.add_msg("No more free affine blocks and strict affinity enabled");
                    }
                    debug!("No more free affine blocks");
                    break;
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

    /// upstream's `determinePools` + `filterPoolsByUse` + the split of the affine blocks:
    /// the pools selecting this node (or the requested ones), those of them allowed for
    /// workloads, the enabled pools of the family, and the affine blocks inside the allowed
    /// pools (in list order).
    fn usable_pools_and_blocks(
        &self,
        view: &HostView,
        version: u8,
        requested: &[IpNet],
        namespace_labels: &BTreeMap<String, String>,
    ) -> Result<UsablePools, IpamError> {
        let enabled: Vec<IpPool> = view
            .pools
            .iter()
            .filter(|p| p.is_enabled() && p.cidr().is_some_and(|c| c.version() == version))
            .cloned()
            .collect();
        let bits = if version == 4 { 32 } else { 128 };
        let qualified: Vec<&IpPool> = enabled
            .iter()
            .filter(|p| p.spec.block_size <= bits)
            .collect();
        if qualified.is_empty() {
            return Err(IpamError::NoQualifiedPool);
        }
        let selecting: Vec<IpPool> = if !requested.is_empty() {
            let mut out = Vec::new();
            for r in requested {
                let found = qualified.iter().find(|p| p.cidr() == Some(r.masked()));
                match found {
                    Some(p) => out.push((*p).clone()),
                    None => return Err(IpamError::PoolNotEnabled(r.masked().to_string())),
                }
            }
            out
        } else {
            let mut out = Vec::new();
            for p in &enabled {
                if p.spec.assignment_mode != "Automatic" {
                    continue;
                }
                if !selects(&p.spec.node_selector, &view.labels)?
                    || !selects(&p.spec.namespace_selector, namespace_labels)?
                {
                    continue;
                }
                out.push(p.clone());
            }
            out
        };
        if selecting.is_empty() {
            return Err(IpamError::NoPoolsForNode(self.host.clone()));
        }
        let allowed: Vec<IpPool> = selecting
            .iter()
            .filter(|p| {
                p.spec
                    .allowed_uses
                    .iter()
                    .any(|u| u == INTENDED_USE_WORKLOAD)
            })
            .cloned()
            .collect();
        if allowed.is_empty() {
            return Err(IpamError::NoPoolForUse);
        }
        let affine: Vec<IpNet> = view
            .affine
            .iter()
            .filter(|cidr| cidr.version() == version && in_pools(cidr, &allowed))
            .copied()
            .collect();
        Ok(UsablePools {
            allowed,
            selecting,
            enabled,
            affine,
        })
    }

    /// Affine blocks outside the pools selecting this node, whose (enabled) pool no longer
    /// selects it, are given up when empty (upstream's `prepareAffinityBlocksForHost`).
    /// A block without an enabled pool, or whose pool's selector does not parse, is kept.
    /// Failures are only logged.
    async fn release_deselected_affinities(
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
    async fn ensure_consistent_affinity(&self, block: &AllocationBlock) {
        let Some((kind, host)) = block.affinity.as_deref().and_then(parse_affinity) else {
            return;
        };
        let node: Result<Node, _> = get_resource(self.ds, Kind::Node, None, host).await;
        let labels = match node {
            Ok(n) => n.metadata.labels.unwrap_or_default(),
            Err(e) => {
                debug!(host, error = %e, "cannot read the affine node; keeping the affinity");
                return;
            }
        };
        let Ok(pools) = self.pools().await else {
            return;
        };
        let enabled: Vec<IpPool> = pools.into_iter().filter(IpPool::is_enabled).collect();
        let Some(pool) = pool_of(&block.cidr, &enabled) else {
            return;
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

    /// Finds an affine block with room, or claims a new one. Returns (cidr, newly claimed).
    async fn find_or_claim_block(
        &self,
        affine: &mut Vec<IpNet>,
        pools: &[IpPool],
        config: &IpamConfig,
        reserved: &[IpNet],
        allow_new_claim: bool,
    ) -> Result<(IpNet, bool, Option<(AllocationBlock, Revision)>), FindError> {
        // A. Existing affine blocks, in order.
        while !affine.is_empty() {
            let cidr = affine.remove(0);
            if wholly_reserved(&cidr, reserved) {
                continue;
            }
            for _ in 0..DATASTORE_RETRIES {
                // The affinity (as listed, the first time) and its block in one round trip.
                let key = Key::host_affinity(&self.host, cidr);
                let listed = self
                    .listed_affinities
                    .lock()
                    .ok()
                    .and_then(|mut l| l.remove(&cidr));
                let (aff, block) = tokio::join!(
                    async {
                        match listed {
                            Some(kv) => Ok(kv),
                            None => self.ds.get(&key).await,
                        }
                    },
                    self.get_block(cidr)
                );
                let aff = match aff {
                    Ok(kv) => kv,
                    Err(e) => {
                        debug!(%cidr, error = %e, "affinity vanished");
                        break;
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
                            return Ok((cidr, false, Some((block, rev))));
                        }
                        break;
                    }
                    Err(ClaimError::Conflict) => continue,
                    Err(ClaimError::StaleAffinity) | Err(ClaimError::ClaimConflict) => break,
                    Err(ClaimError::Fatal(e)) => {
                        warn!(%cidr, error = %e, "error using affine block");
                        break;
                    }
                }
            }
        }

        // B. Claim a new block.
        if !allow_new_claim {
            return Err(FindError::Fatal(IpamError::BlockLimit));
        }
        if !config.auto_allocate_blocks {
            return Err(FindError::Fatal(IpamError::AutoAllocateDisabled));
        }
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
    async fn pending_affinity(&self, cidr: IpNet) -> Result<(BlockAffinity, Revision), ClaimError> {
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

    async fn claim_affine_block(
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
        let now = timefmt::now().0;
        for cidr in reclaim {
            let Some(info) = index.get(&cidr) else {
                continue;
            };
            let old_enough = info
                .claim_time
                .as_deref()
                .and_then(timefmt::parse_rfc3339)
                .is_none_or(|t| now - t >= EMPTY_BLOCK_MIN_RECLAIM_AGE_SECS);
            if !old_enough {
                continue;
            }
            // Only an owned block can be reclaimed (upstream's releaseBlockAffinity refuses
            // an empty host): an empty block without affinity is left to borrowing.
            let Some((kind, owner)) = info.affinity.as_deref().and_then(parse_affinity) else {
                debug!(%cidr, "empty block has no owner to reclaim it from");
                continue;
            };
            match self
                .release_block_affinity(kind, owner, cidr, true, Some(info.seq))
                .await
            {
                Ok(()) => {
                    info!(%cidr, "reclaiming empty block");
                    return Ok(cidr);
                }
                Err(e) => debug!(%cidr, error = %e, "could not reclaim empty block"),
            }
        }
        Err(FindError::NoFreeBlocks)
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
                Ok(ips) => return Ok(ips),
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
            .map_err(|e| IpamError::Block(e.to_string()))?;
        if ips.is_empty() {
            return Ok(ips);
        }
        let cidr = block.cidr;
        self.increment_handle(&args.handle_id, cidr, ips.len())
            .await?;
        if let Err(e) = self.update_block(&mut block, &rev).await {
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

    /// The CIDRs of all existing blocks (of one IP version).
    async fn block_cidrs(&self, version: Option<u8>) -> Result<Vec<IpNet>, IpamError> {
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

    // ---------------------------------------------------------------- handles

    async fn increment_handle(&self, id: &str, cidr: IpNet, n: usize) -> Result<(), IpamError> {
        let key = Key::Handle { id: id.to_string() };
        // Most handles are new: try the create first (one round trip), else read-modify-write.
        let mut fresh = IpamHandle::default();
        fresh.block.insert(cidr.to_string(), n as i64);
        match self.ds.create(&key, &to_value(&fresh)?).await {
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
    async fn handle_write_landed(
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
    async fn decrement_handle(
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

    // --------------------------------------------------------------- AssignIP

    /// Assigns exactly `ip` to `handle_id` (CNI_ARGS `IP=`).
    pub async fn assign_ip(
        &self,
        ip: IpAddr,
        handle_id: &str,
        attrs: &BTreeMap<String, String>,
    ) -> Result<IpNet, IpamError> {
        // The config is read with the pools (one round trip) but only created once the
        // address is known to be in an enabled pool, as upstream.
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
        for _ in 0..DATASTORE_RETRIES {
            let (mut block, rev) = match self.get_block(cidr).await? {
                Some(b) => b,
                None => {
                    let (aff, arev) = match self.pending_affinity(cidr).await {
                        Ok(a) => a,
                        Err(ClaimError::Fatal(e)) => return Err(e),
                        Err(_) => continue,
                    };
                    match self.claim_affine_block(cidr, aff, arev).await {
                        Ok(_) | Err(ClaimError::ClaimConflict) | Err(ClaimError::Conflict) => {}
                        Err(ClaimError::StaleAffinity) => {}
                        Err(ClaimError::Fatal(e)) => return Err(e),
                    }
                    continue;
                }
            };
            match block.assign(ip, handle_id, attrs, &self.host, config.strict_affinity) {
                Ok(()) => {}
                Err(BlockError::AlreadyAssigned(_)) => return Err(IpamError::AddressInUse(ip)),
                Err(e) => return Err(IpamError::Block(e.to_string())),
            }
            self.increment_handle(handle_id, cidr, 1).await?;
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

    // ---------------------------------------------------------------- release

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

    /// `release_by_handle` on the handle as just read (`kv`).
    pub async fn release_read_handle(&self, handle_id: &str, kv: KvPair) -> Result<(), IpamError> {
        let handle: IpamHandle = kv.decode()?;
        // The handle as just read serves the first decrement (a CAS write: if it moved, the
        // decrement reads it again).
        let mut read = Some(kv);
        let mut deleted = false;
        for cidr_s in handle.block.keys() {
            let Ok(cidr) = cidr_s.parse::<IpNet>() else {
                warn!(block = %cidr_s, "handle names an unparsable block");
                continue;
            };
            let released = self.release_handle_in_block(handle_id, cidr).await?;
            if released > 0 {
                match self
                    .decrement_handle(handle_id, cidr, released, read.take())
                    .await
                {
                    Ok(gone) => deleted |= gone,
                    Err(IpamError::Datastore(e)) if e.is_not_found() => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if deleted {
            return Ok(());
        }
        // Every address of the handle is released now. If the handle survived (its count
        // was off: a crash between writes, or a write retried after a lost answer), check
        // that no block still holds it and remove it: DEL leaves no handle behind.
        let key = Key::Handle {
            id: handle_id.to_string(),
        };
        if let Ok(kv) = self.ds.get(&key).await {
            let left: IpamHandle = kv.decode()?;
            let mut holds = false;
            for cidr in left.block.keys().filter_map(|c| c.parse::<IpNet>().ok()) {
                if let Some((b, _)) = self.get_block(cidr).await? {
                    holds |= b.holds_handle(handle_id);
                }
            }
            if !holds {
                warn!(
                    handle = handle_id,
                    "removing a handle whose counts were off"
                );
                match self.ds.delete(&key, Some(&kv.revision)).await {
                    Ok(()) => {}
                    Err(e) if e.is_not_found() || e.is_conflict() => {}
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    async fn release_handle_in_block(
        &self,
        handle_id: &str,
        cidr: IpNet,
    ) -> Result<usize, IpamError> {
        for _ in 0..DATASTORE_RETRIES {
            let Some((mut block, rev)) = self.get_block(cidr).await? else {
                return Ok(0);
            };
            let n = block.release_by_handle(handle_id);
            if n == 0 {
                return Ok(0);
            }
            match self.write_released(&mut block, &rev).await {
                Ok(()) => {
                    if block.is_empty() && block.affinity.is_some() {
                        self.ensure_consistent_affinity(&block).await;
                    }
                    return Ok(n);
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
                            self.ensure_consistent_affinity(&block).await;
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
}

/// What AutoAssign reads once per call: config, reservations, this node's labels, all
/// pools and this host's affine blocks.
/// The answers of AutoAssign's up-front reads (`Ipam::read_view`), errors kept so that they
/// surface in upstream's order when used.
pub struct ViewReads {
    config: Result<Option<IpamConfig>, IpamError>,
    reserved: Result<Vec<IpNet>, IpamError>,
    labels: Result<Option<BTreeMap<String, String>>, IpamError>,
    pools: Result<Vec<IpPool>, IpamError>,
    affs: Result<Vec<KvPair>, DatastoreError>,
}

impl ViewReads {
    /// The pools read, when the read succeeded.
    pub fn pools(&self) -> Option<&[IpPool]> {
        self.pools.as_deref().ok()
    }
}

/// Whether a node selector looks at labels at all (`""` and `all()` do not).
fn selector_needs_labels(selector: &str) -> bool {
    let s = selector.trim();
    !(s.is_empty() || s == "all()")
}

struct HostView {
    reserved: Vec<IpNet>,
    labels: BTreeMap<String, String>,
    pools: Vec<IpPool>,
    affine: Vec<IpNet>,
}

/// The pools one family may use (see `usable_pools_and_blocks`).
struct UsablePools {
    allowed: Vec<IpPool>,
    selecting: Vec<IpPool>,
    enabled: Vec<IpPool>,
    affine: Vec<IpNet>,
}

enum FindError {
    NoFreeBlocks,
    Fatal(IpamError),
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

/// upstream's `SelectsNode`/`SelectsNamespace`: an empty selector selects everything; one
/// that does not parse is an error (the parser's text).
fn selects(sel: &str, labels: &BTreeMap<String, String>) -> Result<bool, IpamError> {
    if sel.is_empty() {
        return Ok(true);
    }
    selector::parse(sel)
        .map(|s| s.matches(labels))
        .map_err(|e| IpamError::Selector(e.to_string()))
}

/// Whether `cidr` lies inside one of `pools`.
fn in_pools(cidr: &IpNet, pools: &[IpPool]) -> bool {
    pool_of(cidr, pools).is_some()
}

/// The pool `cidr` lies in.
fn pool_of<'p>(cidr: &IpNet, pools: &'p [IpPool]) -> Option<&'p IpPool> {
    pools
        .iter()
        .find(|p| p.cidr().is_some_and(|pc| pc.covers(cidr)))
}

/// A block's `affinity` (`host:node1`, `virtual:load-balancer`) as (type, host); anything
/// else (no affinity, an unknown type) names no owner.
fn parse_affinity(a: &str) -> Option<(&'static str, &str)> {
    for kind in ["host", "virtual"] {
        if let Some(host) = a.strip_prefix(kind).and_then(|r| r.strip_prefix(':')) {
            return Some((kind, host));
        }
    }
    None
}

/// Orders blocks of `pool` as `host`'s random walk would visit them: by their distance from
/// the walk's first block, wrapping at the end of the pool.
fn sort_in_walk_order(blocks: &mut [IpNet], pool: IpNet, block_size: u8, host: &str) {
    let Some(first) = block_generator(pool, block_size, host).next() else {
        return;
    };
    let shift = u32::from(pool.bits().saturating_sub(block_size));
    let base = crate::net::to_u128(pool.masked().addr);
    let index = |c: &IpNet| crate::net::to_u128(c.addr).wrapping_sub(base) >> shift;
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

fn wholly_reserved(cidr: &IpNet, reserved: &[IpNet]) -> bool {
    reserved.iter().any(|r| r.masked().covers(cidr))
}

/// A reservation entry: a CIDR, or a bare address meaning /32 or /128.
fn parse_cidr_or_ip(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::host))
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

    #[test]
    fn block_limits() {
        assert_eq!(max_blocks(0, 0), DEFAULT_MAX_BLOCKS_PER_HOST);
        assert_eq!(max_blocks(0, 3), 3);
        assert_eq!(max_blocks(5, 3), 3);
        assert_eq!(max_blocks(1, 0), 1);
    }
}

#[cfg(test)]
#[path = "allocator_tests.rs"]
mod store_tests;
