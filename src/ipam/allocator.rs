//! Calico's IPAM allocator over the `Datastore` trait (libcalico-go `lib/ipam`):
//! AutoAssign (affine blocks, the pending → block → confirmed claim protocol, borrowing),
//! AssignIP, ReleaseByHandle and ReleaseIPs. Every write is a compare-and-swap retried a
//! bounded number of times, so concurrent callers on many nodes never hand out an address
//! twice.
//!
//! This module holds the public API (upstream's `interface.go`, `ipam_types.go`,
//! `ipam_errors.go`): the `Ipam` type, its arguments, results and errors. The work is split
//! along upstream's seams, each sub-module adding an `impl` block to `Ipam`:
//! - `assign`: AutoAssign and AssignIP (`ipam.go`),
//! - `claim`: block reads and writes and the block claim protocol
//!   (`ipam_block_reader_writer.go`),
//! - `config`: IPAMConfig (`ipam.go`'s `GetIPAMConfig`),
//! - `handle`: IPAM handle counts (`ipam_handle.go`),
//! - `owners`: a handle's addresses and their owners (`ipam_attributes.go`),
//! - `pools`: which pools a request may use (`pools.go`, `determinePools`),
//! - `release`: ReleaseIPs, ReleaseByHandle, affinity release (`ipam.go`),
//! - `gc`: CNI 1.1 GC of this node's handles of containers that are gone (no upstream
//!   counterpart in the CNI; kube-controllers' IPAM GC does the cluster-wide part).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::IpAddr;

use crate::datastore::model::{AllocationBlock, IpPool, IpamConfig};
use crate::datastore::{Datastore, DatastoreError, KvPair, Revision};
use crate::ipam::lock::Journal;
use crate::support::net::IpNet;

mod assign;
mod claim;
mod config;
pub mod gc;
mod handle;
mod owners;
mod pools;
mod release;

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
    #[error(transparent)]
    Selector(#[from] crate::ipam::selector::SelectorError),
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
    /// A block refused an assignment (`block.rs`).
    #[error(transparent)]
    Block(#[from] crate::ipam::block::BlockError),
    /// A block write reported applied whose addresses the block does not hold.
    #[error("block write not found")]
    BlockWriteNotFound,
    /// Reading the Node failed: upstream returns the datastore error as it is.
    #[error(transparent)]
    Node(DatastoreError),
    #[error(transparent)]
    Owner(#[from] crate::ipam::owner::OwnerError),
    /// A handle limited to `max` addresses per IP version has them (KubeVirt VMs).
    #[error(
        "handle {handle} already has {have} allocation(s), cannot allocate more (maxAlloc={max})"
    )]
    MaxAllocReached {
        handle: String,
        have: i64,
        max: usize,
    },
    #[error("{0}")]
    Other(String),
}

/// What re-reading an object says about a write that failed with anything but a conflict
/// (a lost answer: a timeout or a dropped connection after the server applied it).
enum Landed {
    Yes,
    No,
    /// The re-read failed too: the write may or may not have been applied.
    Unknown(DatastoreError),
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
    /// At most this many addresses per IP version on the handle, counted in the handle
    /// itself (its compare-and-swap makes concurrent callers agree): a KubeVirt VM's.
    pub max_per_version: Option<usize>,
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
    /// Blocks read early on the IPAM lock file's hint (`read_view`): the first look at an
    /// affine block uses its early copy instead of reading it again (a retry reads afresh).
    prefetched_blocks: std::sync::Mutex<HashMap<IpNet, (AllocationBlock, Revision)>>,
    /// The blocks this call assigned from, in order (the next call's hint).
    assigned_blocks: std::sync::Mutex<Vec<IpNet>>,
    /// The IPAM lock file's journal, when the host's lock is held: with it, a new handle
    /// and its block are written together where the datastore cannot write both at once
    /// (`assign::write_handle_beside_block`).
    journal: std::sync::Mutex<Option<Journal>>,
    /// A write of the caller's that goes out with the block write giving the call all its
    /// addresses (`assign::write_handle_beside_block`): one round trip instead of two.
    beside: Option<&'a dyn WriteBeside>,
}

/// A write that depends only on the addresses a call is given (the Kubernetes datastore's
/// endpoint: the pod's address annotations), sent with the block write that gives them.
/// It may run more than once (the block write lost its compare-and-swap and another address
/// is tried) or for addresses the call does not get in the end (the block write failed): the
/// caller tells from what it recorded whether it must write again or take the write back.
pub trait WriteBeside {
    fn write<'w>(&'w self, ips: &'w [IpNet]) -> std::pin::Pin<Box<dyn Future<Output = ()> + 'w>>;
}

impl<'a, D: Datastore> Ipam<'a, D> {
    pub fn new(ds: &'a D, host: &str) -> Self {
        Ipam {
            ds,
            host: host.to_string(),
            listed_affinities: Default::default(),
            prefetched_blocks: Default::default(),
            assigned_blocks: Default::default(),
            journal: Default::default(),
            beside: None,
        }
    }

    /// Sends `beside` with the block write that gives this call all its addresses.
    pub fn write_beside(mut self, beside: Option<&'a dyn WriteBeside>) -> Self {
        self.beside = beside;
        self
    }

    /// Keeps the lock file's journal (`IpamLock::journal`) for this call's writes.
    pub fn keep_journal(&self, journal: Option<Journal>) {
        if let Ok(mut j) = self.journal.lock() {
            *j = journal;
        }
    }

    fn journal(&self) -> Option<Journal> {
        self.journal.lock().ok().and_then(|j| j.clone())
    }

    /// The blocks this call assigned from, in order, each once.
    pub fn assigned_blocks(&self) -> Vec<IpNet> {
        self.assigned_blocks
            .lock()
            .map(|b| b.clone())
            .unwrap_or_default()
    }

    fn note_assigned_block(&self, cidr: IpNet) {
        if let Ok(mut b) = self.assigned_blocks.lock() {
            if !b.contains(&cidr) {
                b.push(cidr);
            }
        }
    }

    fn host_affinity(&self) -> String {
        format!("host:{}", self.host)
    }
}

/// What AutoAssign reads once per call: config, reservations, this node's labels, all
/// pools and this host's affine blocks.
/// The answers of AutoAssign's up-front reads (`Ipam::read_view`), errors kept so that they
/// surface in upstream's order when used.
pub struct ViewReads {
    config: Result<Option<IpamConfig>, IpamError>,
    reserved: Result<Vec<IpNet>, IpamError>,
    labels: Result<BTreeMap<String, String>, IpamError>,
    pools: Result<Vec<IpPool>, IpamError>,
    affs: Result<Vec<KvPair>, DatastoreError>,
    /// The hinted blocks that exist, as read.
    hinted: Vec<(IpNet, (AllocationBlock, Revision))>,
}

impl ViewReads {
    /// The pools read, when the read succeeded.
    pub fn pools(&self) -> Option<&[IpPool]> {
        self.pools.as_deref().ok()
    }
}

#[cfg(test)]
#[path = "allocator_tests.rs"]
mod store_tests;
