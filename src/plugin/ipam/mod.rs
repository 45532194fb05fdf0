//! The IPAM a `calico` call delegates to (its NetConf's `ipam` section), picked once per call
//! by `pick`, as netavark's `get_network_driver` picks a network driver:
//! * Calico IPAM in this process (`in_process::InProcess`), when `ipam.type` is `calico-ipam` and
//!   that plugin in CNI_PATH is this very executable: the same code as a separate
//!   `calico-ipam`, on the datastore connection the call already has;
//! * any other plugin (a separate calico-ipam, host-local, ...) executed from CNI_PATH
//!   (`exec::Exec`, libcni's `ipam.ExecAdd/ExecDel`), azure-vnet-ipam with the state it
//!   needs on disk (`azure`).
//!
//! The plugin's steps see only `IpamDriver`, so their undo paths can be tested with a fake.
//! What a driver reads ahead of ADD is its own (`IpamDriver::View`, read by `read_view` in
//! the call's first round trip); what the call knows that an IPAM may use instead of reading
//! it again is `AddHints`.

#[cfg(test)]
pub mod fake;
pub mod in_process;

use std::collections::BTreeSet;
use std::net::IpAddr;

use tracing::{debug, warn};

use crate::calico_ipam::add::{read_locked_view, LockedView};
use crate::calico_ipam::kube_reads::KubeReads;
use crate::delegate::exec;
use crate::error::{Error, GcError, Result};
use crate::ipam::allocator::gc::NodeHandles;
use crate::plugin::k8s_pod::PodInfo;

pub use crate::config::IpamKind;
use crate::skel::{CmdArgs, CniError, CniResult};

/// A write that depends only on the addresses an IPAM gives, which it may send with its own
/// write of them (Calico IPAM's block write).
pub use crate::ipam::allocator::WriteBeside;

/// What GC needs besides the runtime's arguments: the node's Calico IPAM handles of this
/// network (already listed, for the endpoints' GC too) and the valid container IDs.
pub struct GcScope<'a> {
    pub node: &'a str,
    pub handles: Option<&'a NodeHandles>,
    pub valid: &'a BTreeSet<String>,
}

/// What an ADD's call knows that its IPAM may use instead of reading it again, and a write
/// the IPAM may send with its own. An IPAM run from CNI_PATH uses none of it.
#[derive(Clone, Copy, Default)]
pub struct AddHints<'a> {
    /// The Kubernetes pod and its namespace, when the call read them (policy type k8s).
    pub pod: Option<&'a PodInfo>,
    /// The endpoint's write, to go with the write that gives the addresses.
    pub beside: Option<&'a dyn WriteBeside>,
}

/// The operations a `calico` call needs from its IPAM. Single-threaded runtime: no `Send`.
#[allow(async_fn_in_trait)]
pub trait IpamDriver {
    /// What this IPAM reads and holds for an ADD, when the plan has it read in the call's
    /// first round trip (`read_view`); its `Default` is nothing read.
    type View: Default;
    /// Reads (and holds) this IPAM's `View`, ahead of ADD's checks.
    async fn read_view(&self) -> Self::View;
    /// ADD: the addresses, in the 1.0 result model, on `view` (read ahead, or the default)
    /// and with what the call knows (`hints`).
    async fn add(&self, args: &CmdArgs, view: Self::View, hints: AddHints<'_>)
        -> Result<CniResult>;
    /// DEL: everything the IPAM holds for this container.
    async fn del(&self, args: &CmdArgs) -> Result<()>;
    /// The rollback of a failed ADD: gives back exactly `ips`. With Calico IPAM (wherever it
    /// runs) they are released by address, and only while they still belong to this call's
    /// handle, so an address another ADD of the same sandbox holds survives; any other IPAM
    /// only has DEL (upstream's `ReleaseIPAllocation`). Failures are only logged.
    async fn give_back(&self, args: &CmdArgs, ips: &[IpAddr]);
    /// CHECK: the IPAM still holds the previous result's addresses.
    async fn check(&self, args: &CmdArgs, prev: &CniResult) -> Result<()>;
    /// STATUS (the spec's delegation to the IPAM plugin).
    async fn status(&self, args: &CmdArgs) -> Result<()>;
    /// GC: releases what gone attachments hold; what failed.
    async fn gc(&self, args: &CmdArgs, scope: &GcScope<'_>) -> Vec<Error>;
}

/// The driver of one call.
pub enum Driver<'a, D> {
    InProcess(in_process::InProcess<'a, D>),
    /// `calico_store`: the datastore, when the executed plugin is Calico IPAM (for
    /// `give_back` by address).
    Exec {
        exec: exec::Exec,
        calico_store: Option<&'a D>,
    },
}

/// Whether Calico IPAM runs in this process: `ipam.type` is `calico-ipam` and that plugin in
/// CNI_PATH is this executable. Asked once per call (the plan keeps the answer).
pub fn runs_in_process(kind: IpamKind, ipam_type: &str, cni_path: &str) -> bool {
    kind == IpamKind::Calico && exec::is_this_executable(ipam_type, cni_path)
}

/// The one factory: the driver for a call whose NetConf and identifiers are `known` (parsed
/// from `stdin`), on datastore `ds`.
pub fn pick<'a, D: KubeReads>(
    in_process: bool,
    ds: &'a D,
    known: crate::calico_ipam::call::Known<'a>,
    stdin: &'a [u8],
) -> Driver<'a, D> {
    let ipam_type = known.conf.ipam.ipam_type.as_str();
    if in_process {
        return Driver::InProcess(in_process::InProcess { ds, known, stdin });
    }
    let calico_store = (IpamKind::of(ipam_type) == IpamKind::Calico).then_some(ds);
    Driver::Exec {
        exec: exec::Exec::for_network(ipam_type, &known.conf.name),
        calico_store,
    }
}

impl<D: KubeReads> IpamDriver for Driver<'_, D> {
    /// Calico IPAM's: the host's lock and AutoAssign's reads. A plugin run from CNI_PATH
    /// reads nothing ahead (it takes its own lock, in its own process).
    type View = LockedView;

    async fn read_view(&self) -> LockedView {
        match self {
            Driver::InProcess(ipam) => {
                let known = ipam.known;
                Box::pin(read_locked_view(
                    ipam.ds,
                    known.conf.ipam_lock_file(),
                    &known.ids.node,
                ))
                .await
            }
            Driver::Exec { .. } => LockedView::default(),
        }
    }

    async fn add(
        &self,
        args: &CmdArgs,
        view: LockedView,
        hints: AddHints<'_>,
    ) -> Result<CniResult> {
        match self {
            // Boxed: the IPAM's state machine is large, and the poll functions of every
            // future holding it inline reserve (and probe, page by page) stack for it.
            Driver::InProcess(ipam) => Box::pin(ipam.add(args, view, hints)).await,
            Driver::Exec { exec, .. } => {
                drop(view);
                Ok(exec.add(args).await?)
            }
        }
    }

    async fn del(&self, args: &CmdArgs) -> Result<()> {
        match self {
            Driver::InProcess(ipam) => Box::pin(ipam.del(args)).await,
            Driver::Exec { exec, .. } => Ok(exec.del(args).await?),
        }
    }

    async fn give_back(&self, args: &CmdArgs, ips: &[IpAddr]) {
        let store = match self {
            Driver::InProcess(ipam) => Some(ipam.ds),
            Driver::Exec { calico_store, .. } => *calico_store,
        };
        let released = match store {
            Some(ds) => {
                debug!(addresses = ?ips, "releasing this call's addresses after a failed ADD");
                Box::pin(crate::calico_ipam::del::release_addresses(
                    ds,
                    &crate::calico_ipam::call::ipam_args(args),
                    ips,
                ))
                .await
            }
            None => {
                debug!("releasing IPAM allocation after a failed ADD");
                self.del(args).await
            }
        };
        if let Err(e) = released {
            warn!(error = %e, "failed to release IPAM allocation");
        }
    }

    async fn check(&self, args: &CmdArgs, prev: &CniResult) -> Result<()> {
        match self {
            Driver::InProcess(ipam) => ipam.check(prev).await,
            Driver::Exec { exec, .. } if exec.plugin.is_empty() => Ok(()),
            Driver::Exec { exec, .. } => Ok(exec.check(args).await?),
        }
    }

    async fn status(&self, args: &CmdArgs) -> Result<()> {
        match self {
            // It would repeat the very read `calico` STATUS has just made.
            Driver::InProcess(_) => Ok(()),
            Driver::Exec { exec, .. } if exec.plugin.is_empty() => Ok(()),
            Driver::Exec { exec, .. } => Ok(exec.verb("STATUS", args).await?),
        }
    }

    async fn gc(&self, args: &CmdArgs, scope: &GcScope<'_>) -> Vec<Error> {
        match self {
            Driver::InProcess(ipam) => match scope.handles {
                Some(h) => {
                    let outcome = ipam.gc(scope.node, h, scope.valid).await;
                    let failed = outcome.failures.into_iter();
                    failed.map(|f| Error::chain(f.handle, f.source)).collect()
                }
                None => vec![GcError::AddressesNotCollected.into()],
            },
            Driver::Exec { exec, .. } if exec.plugin.is_empty() => Vec::new(),
            Driver::Exec { exec, .. } => match exec.verb("GC", args).await {
                Ok(()) => Vec::new(),
                // The plugin's failure as the CNI error it printed (its `msg`).
                Err(e) => {
                    let said = Error::Cni(CniError::from(Error::from(e)));
                    vec![Error::chain(format!("{} GC", exec.plugin), said)]
                }
            },
        }
    }
}
