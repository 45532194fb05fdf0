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
//!
//! Only what passed before the reads is known then: the ready gate, the endpoint's name and
//! the pod's annotations are checked after. An ADD that fails before using them undoes
//! them (`Early::discard`), so a refused ADD still leaves nothing. A kill in between is
//! cleaned up by the runtime's DEL, as a kill while IPAM runs: DEL removes the pod's
//! interface and releases the handle `<network>.<containerID>` the addresses are under.

use std::net::IpAddr;

use tracing::warn;

use crate::dataplane::{
    AnyInterface, Dataplane, DataplaneError, PodInterface, Selected, VethPair, VethRequest,
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
    /// Calico IPAM's answer from before the pod was read.
    addresses: Option<Result<CniResult>>,
}

impl Early {
    pub fn new(dataplane: Selected) -> Early {
        Early {
            pair: Some(PairSource::Later(dataplane)),
            addresses: None,
        }
    }

    /// Builds the pair for `req` now, on the Linux dataplane (the gRPC dataplane's agent
    /// is asked when IPAM starts, as before).
    pub async fn build_pair(&mut self, req: VethRequest) {
        self.pair = match self.pair.take() {
            Some(PairSource::Later(Selected::Linux(linux))) => {
                Some(PairSource::Early(Box::new(linux.prepare(req).await)))
            }
            other => other,
        };
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
