//! A Kubernetes ADD's veth pair, built while the call's first reads are answered.
//!
//! Those reads wait on the network: the API server's TLS handshake and its answer for the
//! pod and namespace (policy type k8s), or the IPAM reads. The pair is the kernel's work
//! on this thread; built after the reads, alongside IPAM's writes, it delayed their
//! answers. So it is built with the reads, for what the configuration tells before the pod
//! is read: the names, the MTU, the queues and the expected address families. Once the pod
//! is read, the request it makes (its `hwAddr` MAC, its families) is applied to that pair
//! (`VethPair::adopt`).
//!
//! Only what passed before the reads is known then: the datastore's ready gate, the
//! endpoint's name and the pod's annotations are checked after. An ADD that fails before it
//! would have built the pair removes it (`PairSlot::discard`), so a refused ADD still
//! leaves no interface. A kill in between is cleaned up by the runtime's DEL, which removes
//! the pod's interface whatever the datastore holds, as for a kill while IPAM runs.

use tracing::warn;

use crate::dataplane::{
    AnyInterface, Dataplane, DataplaneError, PodInterface, Selected, VethPair, VethRequest,
};
use crate::error::{Error, Result};
use crate::plugin::add_tail::undo;

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

/// The ADD's pair source until IPAM takes it.
pub struct PairSlot(Option<PairSource>);

impl PairSlot {
    pub fn new(dataplane: Selected) -> PairSlot {
        PairSlot(Some(PairSource::Later(dataplane)))
    }

    /// Builds the pair for `req` now, on the Linux dataplane (the gRPC dataplane's agent
    /// is asked when IPAM starts, as before).
    pub async fn build_now(&mut self, req: VethRequest) {
        self.0 = match self.0.take() {
            Some(PairSource::Later(Selected::Linux(linux))) => {
                Some(PairSource::Early(Box::new(linux.prepare(req).await)))
            }
            other => other,
        };
    }

    /// The source, for the step that builds or takes over the pair (once).
    pub fn take(&mut self) -> Result<PairSource> {
        self.0
            .take()
            .ok_or_else(|| Error::msg("internal error: the veth pair was taken twice"))
    }

    /// After a failure before IPAM: removes a pair built with the reads (nothing else was
    /// made by then).
    pub async fn discard(&mut self) {
        let Some(PairSource::Early(built)) = self.0.take() else {
            return;
        };
        if let Ok(pair) = *built {
            undo("removing the veth pair of a refused ADD", async {
                if let Err(e) = AnyInterface::Linux(pair).remove().await {
                    warn!(error = %e, "failed to remove the pod interface of a refused ADD");
                }
            })
            .await;
        }
    }
}
