//! ADD's one record of what it has made, and its one rollback.
//!
//! Each step that makes something records it here as it succeeds: the pod's interface
//! (`Stage`), the addresses IPAM gave, and every write of the
//! WorkloadEndpoint (with IPAM's block write, beside the interface, or after it; on the
//! Kubernetes datastore the endpoint is the pod's address annotations). A step that fails
//! leaves nothing of its own (a failed build or `finish` removes what it made; a
//! failed IPAM assignment gives back what it took). When the call fails, `Made::rollback`
//! undoes what the record holds, in the one order that is safe:
//! 1. the interface: it is local and always possible, and its host route must be gone
//!    before its address can go to another pod;
//! 2. the endpoint, if this call's write landed or went unanswered and it is still this
//!    call's (same container and addresses): no endpoint may name addresses being given
//!    back; never a pre-existing endpoint;
//! 3. the addresses, exactly those of this call: never one another ADD of the same sandbox
//!    holds under the same handle.
//!
//! The rollback runs within the call's grace (`deadline::cleanup_bound`): after a failure
//! at the deadline it may go on for `deadline::GRACE` more; what it could not undo, the
//! runtime's DEL does (it removes the interface by name and releases the handle).
//!
//! Generic over the datastore, the IPAM and the dataplane: `commit.rs` tests every
//! interleaving with the memory store and fakes.

use std::cell::RefCell;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use tracing::{debug, info, warn};

use super::interface::Stage;
use crate::dataplane::{
    AddressRequest, Dataplane, DataplaneError, NetworkingResult, PodFacts, PodInterface,
    VethRequest,
};
use crate::datastore::model::{WorkloadEndpoint, WorkloadEndpointSpec};
use crate::datastore::resources::{delete_resource, get_resource};
use crate::datastore::{Datastore, Kind};
use crate::error::{Error, Result};
use crate::plugin::endpoint;
use crate::plugin::ipam::IpamDriver;
use crate::plugin::ipam::WriteBeside;
use crate::skel::CmdArgs;
use crate::support::deadline;
use crate::support::net::IpNet;

/// What one ADD has made so far.
pub struct Made<'a, D, I, P: Dataplane> {
    ipam: &'a I,
    interface: RefCell<Stage<P>>,
    endpoint: EndpointWrites<'a, D>,
    addresses: RefCell<Option<Given>>,
}

/// What IPAM holds for this call.
enum Given {
    /// These addresses, given back by address under `args` (its handle).
    Addresses { args: CmdArgs, ips: Vec<IpAddr> },
    /// An answer without addresses: whatever the handle holds is released (IPAM's DEL).
    NoAddresses { args: CmdArgs },
}

impl<'a, D: Datastore, I: IpamDriver, P: Dataplane> Made<'a, D, I, P> {
    /// Nothing made yet; `dataplane` builds the interface.
    pub fn new(ds: &'a D, ipam: &'a I, dataplane: P) -> Self {
        Made {
            ipam,
            interface: RefCell::new(Stage::Unbuilt(dataplane)),
            endpoint: EndpointWrites {
                ds,
                planned: RefCell::new(None),
                last: RefCell::new(None),
            },
            addresses: RefCell::new(None),
        }
    }

    /// The interface for the pod's request (`Stage::build`).
    pub async fn build_interface(&self, req: VethRequest) -> Result<(), DataplaneError> {
        let stage = self.interface.replace(Stage::Gone);
        let (stage, built) = stage.build(req).await;
        self.interface.replace(stage);
        built
    }

    /// The interface's addresses and routes (`Stage::finish`).
    pub async fn finish_interface(
        &self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> Result<NetworkingResult, DataplaneError> {
        let stage = self.interface.replace(Stage::Gone);
        let (stage, finished) = stage.finish(addrs, pod).await;
        self.interface.replace(stage);
        finished
    }

    /// The container end's MAC, if known before `finish_interface`.
    pub fn known_mac(&self, addrs: &AddressRequest) -> Option<String> {
        self.interface.borrow().known_mac(addrs)
    }

    /// Whether the result gives the addresses as host networks (the dataplane's way).
    pub fn result_has_host_addresses(&self) -> bool {
        self.interface.borrow().result_has_host_addresses()
    }

    /// Records addresses IPAM gave this call under `args`' handle (again: only the new
    /// ones are added).
    pub fn addresses_given(&self, args: &CmdArgs, ips: &[IpAddr]) {
        let mut given = self.addresses.borrow_mut();
        match &mut *given {
            Some(Given::Addresses { ips: held, .. }) => {
                for ip in ips {
                    if !held.contains(ip) {
                        held.push(*ip);
                    }
                }
            }
            _ => {
                *given = Some(Given::Addresses {
                    args: args.clone(),
                    ips: ips.to_vec(),
                })
            }
        }
    }

    /// Records that IPAM answered without addresses (what its handle may hold is released
    /// by the rollback).
    pub fn answered_without_addresses(&self, args: &CmdArgs) {
        let mut given = self.addresses.borrow_mut();
        if given.is_none() {
            *given = Some(Given::NoAddresses { args: args.clone() });
        }
    }

    /// The endpoint's writes.
    pub fn endpoint(&self) -> &EndpointWrites<'a, D> {
        &self.endpoint
    }

    /// Undoes what this call made, in the order that is safe (module comment), within the
    /// call's grace.
    pub async fn rollback(self) {
        let Made {
            ipam,
            interface,
            endpoint,
            addresses,
        } = self;
        let interface = interface.into_inner().take_for_removal();
        let addresses = addresses.into_inner();
        if interface.is_none() && addresses.is_none() && !endpoint.may_be_stored() {
            return;
        }
        let undo = async {
            if let Some(interface) = interface {
                if let Err(e) = interface.remove().await {
                    warn!(error = %e, "failed to remove the pod interface after a failed ADD");
                }
            }
            endpoint.take_back().await;
            match addresses {
                Some(Given::Addresses { args, ips }) => ipam.give_back(&args, &ips).await,
                Some(Given::NoAddresses { args }) => {
                    if let Err(e) = ipam.del(&args).await {
                        warn!(error = %e, "failed to release IPAM allocation");
                    }
                }
                None => {}
            }
        };
        if let Err(e) = deadline::cleanup_bound("undoing a failed ADD", undo).await {
            warn!(error = %e, "the undo of a failed ADD was cut short; DEL will finish it");
        }
    }
}

/// The WorkloadEndpoint's writes by one ADD: with IPAM's block write (as its `WriteBeside`),
/// beside the interface, and after it. What the last write did is kept, so that a write
/// already stored is not made again (`holds`), and the rollback can take back an endpoint
/// that landed or may have (`take_back`).
pub struct EndpointWrites<'a, D> {
    ds: &'a D,
    /// The endpoint as it will be written, but for its addresses (and MAC), once known.
    planned: RefCell<Option<WorkloadEndpoint>>,
    last: RefCell<Option<LastWrite>>,
}

/// The last write of a new endpoint: its addresses and MAC, and what came of it.
#[derive(Clone)]
struct LastWrite {
    ip_networks: Vec<String>,
    mac: String,
    outcome: Written,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Written {
    Landed,
    /// No answer: it may have landed.
    Unknown,
    Refused,
}

impl<D: Datastore> EndpointWrites<'_, D> {
    /// The endpoint as it will be written (before IPAM and the interface add theirs). A
    /// write ahead of the interface is always taken back by the rollback (it is made only
    /// where no ADD has networked the endpoint yet: on the Kubernetes datastore a pod's
    /// address annotations); the write after the interface only for a new endpoint.
    pub fn plan(&self, wep: &WorkloadEndpoint) {
        self.planned.replace(Some(wep.clone()));
    }

    /// Whether the endpoint is stored with exactly these addresses, and this MAC if the
    /// write had one (the Kubernetes datastore's endpoint has none).
    fn holds(&self, wep: &WorkloadEndpoint) -> bool {
        matches!(&*self.last.borrow(), Some(w) if w.outcome == Written::Landed
            && w.ip_networks == wep.spec.ip_networks
            && (w.mac.is_empty() || w.mac == wep.spec.mac))
    }

    fn may_be_stored(&self) -> bool {
        matches!(&*self.last.borrow(), Some(w) if w.outcome != Written::Refused)
    }

    /// Writes the new endpoint ahead of the interface: with `ips` (and `mac`, when known)
    /// filled in. An endpoint already stored so stays; one stored otherwise (or
    /// unanswered) is taken back first. A failure is only recorded: the write after the
    /// interface tries again.
    pub async fn write_planned(&self, ips: &[IpNet], mac: Option<String>) {
        let Some(mut wep) = self.planned.borrow().clone() else {
            return;
        };
        wep.spec.ip_networks = ips
            .iter()
            .map(|n| IpNet::host(n.addr).to_string())
            .collect();
        wep.spec.mac = mac.unwrap_or_default();
        if self.holds(&wep) {
            return;
        }
        self.take_back().await;
        if let Err(e) = self.write_recorded(&mut wep, true).await {
            debug!(error = %e, "the endpoint written ahead of the interface was not stored");
        }
    }

    /// The endpoint's write once the interface is finished, unless a write ahead stored it
    /// as it is (`Ok(true)`). One stored otherwise (its block write lost, another MAC) or
    /// unanswered is taken back first.
    pub async fn write_complete(&self, wep: &mut WorkloadEndpoint) -> Result<bool> {
        if self.holds(wep) {
            return Ok(true);
        }
        self.take_back().await;
        let new = wep.metadata.resource_version.is_empty();
        self.write_recorded(wep, new).await.map(|()| false)
    }

    /// Writes `wep`, recording what came of it when the rollback is to take it back (`ours`).
    async fn write_recorded(&self, wep: &mut WorkloadEndpoint, ours: bool) -> Result<()> {
        let (ip_networks, mac) = (wep.spec.ip_networks.clone(), wep.spec.mac.clone());
        let written = endpoint::write(self.ds, wep).await;
        if ours {
            let outcome = match &written {
                Ok(()) => Written::Landed,
                Err(e) if outcome_unknown(e) => Written::Unknown,
                Err(_) => Written::Refused,
            };
            self.last.replace(Some(LastWrite {
                ip_networks,
                mac,
                outcome,
            }));
        }
        written
    }

    /// Removes the new endpoint a write may have stored, if it is still this call's (same
    /// container and addresses). Once: what it could not remove, DEL will.
    async fn take_back(&self) {
        let last = self.last.take();
        let planned = self.planned.borrow().clone();
        if let (Some(last), Some(mut wep)) = (last, planned) {
            if last.outcome != Written::Refused {
                wep.spec.ip_networks = last.ip_networks;
                remove_own_endpoint(self.ds, &wep).await;
            }
        }
    }
}

impl<D: Datastore> WriteBeside for EndpointWrites<'_, D> {
    fn write<'w>(&'w self, ips: &'w [IpNet]) -> Pin<Box<dyn Future<Output = ()> + 'w>> {
        Box::pin(self.write_planned(ips, None))
    }
}

/// Whether a failed write may have landed all the same (no answer, rather than a refusal).
fn outcome_unknown(e: &Error) -> bool {
    matches!(e, Error::Datastore(e) if e.outcome_unknown())
}

/// Deletes the endpoint a failed ADD may have stored, if it is this call's (same container
/// and addresses), so that no endpoint is left naming addresses that are being given back.
async fn remove_own_endpoint<D: Datastore>(ds: &D, wep: &WorkloadEndpoint) {
    let (ns, name) = (&wep.metadata.namespace, &wep.metadata.name);
    let read =
        get_resource::<_, WorkloadEndpointSpec>(ds, Kind::WorkloadEndpoint, Some(ns), name).await;
    let stored = match read {
        Ok(w) => w,
        Err(e) if e.is_not_found() => return,
        Err(e) => {
            warn!(error = %e, name, "cannot tell whether the endpoint was written");
            return;
        }
    };
    if stored.spec.container_id != wep.spec.container_id
        || stored.spec.ip_networks != wep.spec.ip_networks
    {
        return;
    }
    let rev = Some(stored.metadata.resource_version.as_str());
    match delete_resource(ds, Kind::WorkloadEndpoint, Some(ns), name, rev).await {
        Ok(()) => info!(name, "deleted the endpoint of a failed ADD"),
        Err(e) => warn!(error = %e, name, "failed to delete the endpoint of a failed ADD"),
    }
}
