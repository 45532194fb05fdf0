//! What a Kubernetes ADD starts while its first reads are answered, instead of after them.
//!
//! Those reads wait on the network: the API server's TLS handshake and its answer for the
//! pod and namespace (policy type k8s), or the IPAM reads. Two things need none of it:
//! * the veth pair, the kernel's work on this thread: built for what the configuration
//!   tells (names, MTU, queues, the expected families). Once the pod is read, the request
//!   it makes (its `hwAddr` MAC, its families) is applied to that pair (`VethPair::adopt`).
//! * on etcd with policy type k8s, Calico IPAM's assignment, once the ready gate has passed
//!   (`add::assign_before_pod` says when it may run): the etcd reads and write take less
//!   time than the API server's answer. Kept if the pod and its namespace ask for nothing
//!   else; else given back before the addresses they ask for are assigned.
//! * then, with both, the pair's addresses and routes (`Early::finish_ahead`): what is left
//!   after the pod's answer is the endpoint's write. Kept if the pod asks for the same
//!   pair and addresses (`Early::take_finished`); else the pair is removed with them
//!   (`Early::unfinish`) before any early address is given back, so that no host route
//!   ever points at an address another pod may get.
//!
//! Only what passed before the reads is known then: the ready gate, the endpoint's name and
//! the pod's annotations are checked after. An ADD that fails before using them undoes
//! them (`Early::discard`), so a refused ADD still leaves nothing. A kill in between is
//! cleaned up by the runtime's DEL, as a kill while IPAM runs or after the interface was
//! finished: DEL removes the pod's interface by name (its routes go with it) and releases
//! the handle `<network>.<containerID>` the addresses are under.

use std::net::IpAddr;

use tracing::{info, warn};

use crate::dataplane::{
    AddressRequest, AnyInterface, Dataplane, DataplaneError, NetworkingResult, PodFacts,
    PodInterface, Selected, VethPair, VethRequest,
};
use crate::error::{Error, Result};
use crate::ipam_driver::IpamDriver;
use crate::plugin::add_tail::undo;
use crate::plugin::Call;
use crate::skel::{CmdArgs, CniResult};

/// Where the ADD's pair comes from when IPAM starts.
pub enum PairSource {
    /// Built then, by the call's dataplane.
    Later(Selected),
    /// Built with the reads (the Linux dataplane), or why it could not be.
    Early(Box<std::result::Result<VethPair, DataplaneError>>),
}

impl Dataplane for PairSource {
    type Interface = AnyInterface;

    async fn prepare(self, req: VethRequest) -> std::result::Result<AnyInterface, DataplaneError> {
        match self {
            PairSource::Later(dp) => dp.prepare(req).await,
            PairSource::Early(built) => (*built)?.adopt(req).await.map(AnyInterface::Linux),
        }
    }
}

/// The ADD's early work until the step that would have done it takes it.
pub struct Early {
    pair: Option<PairSource>,
    /// What the early pair was built for.
    built_for: Option<VethRequest>,
    /// Calico IPAM's answer from before the pod was read.
    addresses: Option<Result<CniResult>>,
    /// The early pair with the early addresses and routes (taken out of `pair`).
    finished: Option<FinishedAhead>,
}

/// A pair finished before the pod was read: what it was given and what `finish` answered.
struct FinishedAhead {
    pair: VethPair,
    addrs: AddressRequest,
    net: NetworkingResult,
}

impl Early {
    pub fn new(dataplane: Selected) -> Early {
        Early {
            pair: Some(PairSource::Later(dataplane)),
            built_for: None,
            addresses: None,
            finished: None,
        }
    }

    /// Builds the pair for `req` now, on the Linux dataplane (the gRPC dataplane's agent
    /// is asked when IPAM starts, as before).
    pub async fn build_pair(&mut self, req: VethRequest) {
        self.pair = match self.pair.take() {
            Some(PairSource::Later(Selected::Linux(linux))) => {
                self.built_for = Some(req.clone());
                Some(PairSource::Early(Box::new(linux.prepare(req).await)))
            }
            other => other,
        };
    }

    /// Gives the early pair the early addresses and routes (`addrs` tells them for IPAM's
    /// answer), when both are there. Not where a link had the pair's host-side name (a
    /// re-ADD): replacing it waits until the pod has been read and the ADD accepted, as
    /// without the early work. A failure is only logged: the pair is gone with it
    /// (`finish` removes what it made), and the step after the pod's answer builds it again
    /// for the addresses the pod gets, and reports its own failure.
    pub async fn finish_ahead(&mut self, addrs: impl FnOnce(&CniResult) -> AddressRequest) {
        let addrs = match &self.addresses {
            Some(Ok(assigned)) => addrs(assigned),
            _ => return,
        };
        let mut pair = match self.pair.take() {
            Some(PairSource::Early(built)) => match *built {
                Ok(pair) if pair.is_made() => pair,
                built => {
                    self.pair = Some(PairSource::Early(Box::new(built)));
                    return;
                }
            },
            other => {
                self.pair = other;
                return;
            }
        };
        match pair.finish_addresses(&addrs).await {
            Ok(net) => self.finished = Some(FinishedAhead { pair, addrs, net }),
            Err(e) => {
                info!(error = %e, "the pod interface could not be finished before the pod was read");
                self.pair = Some(PairSource::Early(Box::new(Ok(pair))));
            }
        }
    }

    /// The early addresses with the pair finished for them, if the pod asks for that pair
    /// (`req`, the request as the pod made it) and those addresses (once).
    pub fn take_finished(&mut self, req: &VethRequest) -> Option<(CniResult, PodLink)> {
        let kept = self.finished.is_some()
            && self.built_for.as_ref() == Some(req)
            && matches!(self.addresses, Some(Ok(_)));
        if !kept {
            return None;
        }
        let (Some(Ok(assigned)), Some(f)) = (self.addresses.take(), self.finished.take()) else {
            return None;
        };
        Some((
            assigned,
            PodLink::Ahead {
                pair: f.pair,
                addrs: f.addrs,
                net: f.net,
            },
        ))
    }

    /// Takes the addresses and routes off a pair finished before the pod was read (the
    /// pair goes with them, to be built again), before the early addresses can be given
    /// back. On failure the pair is kept for `discard` to remove.
    pub async fn unfinish(&mut self) -> Result<()> {
        let Some(mut f) = self.finished.take() else {
            return Ok(());
        };
        info!("the pod asks for another interface or other addresses: removing the one finished before it was read");
        let reset = f.pair.reset().await;
        self.pair = Some(PairSource::Early(Box::new(Ok(f.pair))));
        Ok(reset?)
    }

    /// The pair's source, for the step that builds or takes over the pair (once).
    pub fn take_pair(&mut self) -> Result<PairSource> {
        self.pair
            .take()
            .ok_or_else(|| Error::msg("internal error: the veth pair was taken twice"))
    }

    /// Keeps the early assignment's answer until it is used or given back.
    pub fn set_addresses(&mut self, answer: Option<Result<CniResult>>) {
        self.addresses = answer;
    }

    /// The early assignment's answer, if one was made (once).
    pub fn take_addresses(&mut self) -> Option<Result<CniResult>> {
        self.addresses.take()
    }

    /// After a failure: removes a pair built with the reads and gives back addresses
    /// assigned before the pod was read, if the steps that use them had not taken them.
    pub async fn discard(&mut self, call: &Call, args: &CmdArgs) {
        if let Some(f) = self.finished.take() {
            self.pair = Some(PairSource::Early(Box::new(Ok(f.pair))));
        }
        if let Some(PairSource::Early(built)) = self.pair.take() {
            if let Ok(pair) = *built {
                undo("removing the veth pair of a refused ADD", async {
                    if let Err(e) = AnyInterface::Linux(pair).remove().await {
                        warn!(error = %e, "failed to remove the pod interface of a refused ADD");
                    }
                })
                .await;
            }
        }
        if let Some(Ok(assigned)) = self.addresses.take() {
            undo(
                "giving back the addresses of a refused ADD",
                give_back(call, args, &assigned),
            )
            .await;
        }
    }
}

/// Gives back exactly the addresses of `assigned` (`IpamDriver::give_back`).
pub async fn give_back(call: &Call, args: &CmdArgs, assigned: &CniResult) {
    let ips: Vec<IpAddr> = assigned.ips.iter().map(|ip| ip.address.addr).collect();
    call.ipam().give_back(args, &ips).await;
}

/// The ADD's pod interface: finished before the pod was read (`Early::take_finished`), or
/// to be finished now.
pub enum PodLink {
    Ahead {
        pair: VethPair,
        addrs: AddressRequest,
        net: NetworkingResult,
    },
    Later(AnyInterface),
}

impl PodInterface for PodLink {
    /// A pair finished ahead answers what its `finish` did. Asked for other addresses or
    /// routes (not expected: both are worked out from the same answer and configuration),
    /// it is built again for them.
    async fn finish(
        &mut self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> std::result::Result<NetworkingResult, DataplaneError> {
        match self {
            PodLink::Ahead {
                pair,
                addrs: done,
                net,
            } => {
                if done == addrs {
                    return Ok(net.clone());
                }
                pair.reset().await?;
                *net = pair.finish_addresses(addrs).await?;
                *done = addrs.clone();
                Ok(net.clone())
            }
            PodLink::Later(link) => link.finish(addrs, pod).await,
        }
    }

    async fn remove(self) -> std::result::Result<(), DataplaneError> {
        match self {
            PodLink::Ahead { pair, .. } => AnyInterface::Linux(pair).remove().await,
            PodLink::Later(link) => link.remove().await,
        }
    }

    /// None once finished: `finish` has nothing left to do that a write could overlap.
    fn known_mac(&self, addrs: &AddressRequest) -> Option<String> {
        match self {
            PodLink::Ahead { .. } => None,
            PodLink::Later(link) => link.known_mac(addrs),
        }
    }

    fn result_has_host_addresses(&self) -> bool {
        match self {
            PodLink::Ahead { pair, .. } => pair.result_has_host_addresses(),
            PodLink::Later(link) => link.result_has_host_addresses(),
        }
    }
}
