//! Pool selection (upstream's `pools.go` and `determinePools`/`filterPoolsByUse` in
//! `ipam.go`): the pools, reservations and node labels AutoAssign reads, which pools select
//! this node and namespace and allow workloads, and where a block lies among them.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::{Ipam, IpamError, INTENDED_USE_WORKLOAD};
use crate::datastore::model::{IpPool, IpReservation, Node};
use crate::datastore::resources::{get_resource, list_resources};
use crate::datastore::{Datastore, Kind, ListKind};
use crate::ipam::selector;
use crate::support::net::IpNet;

impl<'a, D: Datastore> Ipam<'a, D> {
    pub(super) async fn reservations(&self) -> Result<Vec<IpNet>, IpamError> {
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

    pub(super) async fn node_labels(&self) -> Result<BTreeMap<String, String>, IpamError> {
        let node: Node = get_resource(self.ds, Kind::Node, None, &self.host)
            .await
            .map_err(IpamError::Node)?;
        Ok(node.metadata.labels.unwrap_or_default())
    }

    /// upstream's `determinePools` + `filterPoolsByUse` + the split of the affine blocks:
    /// the pools selecting this node (or the requested ones), those of them allowed for
    /// workloads, the enabled pools of the family, and the affine blocks inside the allowed
    /// pools (in list order).
    pub(super) fn usable_pools_and_blocks(
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
}

/// Whether a node selector looks at labels at all (`""` and `all()` do not).
pub(super) fn selector_needs_labels(selector: &str) -> bool {
    let s = selector.trim();
    !(s.is_empty() || s == "all()")
}

pub(super) struct HostView {
    pub(super) reserved: Vec<IpNet>,
    pub(super) labels: BTreeMap<String, String>,
    pub(super) pools: Vec<IpPool>,
    pub(super) affine: Vec<IpNet>,
}

/// The pools one family may use (see `usable_pools_and_blocks`).
pub(super) struct UsablePools {
    pub(super) allowed: Vec<IpPool>,
    pub(super) selecting: Vec<IpPool>,
    pub(super) enabled: Vec<IpPool>,
    pub(super) affine: Vec<IpNet>,
}

/// upstream's `SelectsNode`/`SelectsNamespace`: an empty selector selects everything; one
/// that does not parse is an error (the parser's text).
pub(super) fn selects(sel: &str, labels: &BTreeMap<String, String>) -> Result<bool, IpamError> {
    if sel.is_empty() {
        return Ok(true);
    }
    selector::parse(sel)
        .map(|s| s.matches(labels))
        .map_err(IpamError::Selector)
}

/// Whether `cidr` lies inside one of `pools`.
pub(super) fn in_pools(cidr: &IpNet, pools: &[IpPool]) -> bool {
    pool_of(cidr, pools).is_some()
}

/// The pool `cidr` lies in.
pub(super) fn pool_of<'p>(cidr: &IpNet, pools: &'p [IpPool]) -> Option<&'p IpPool> {
    pools
        .iter()
        .find(|p| p.cidr().is_some_and(|pc| pc.covers(cidr)))
}

pub(super) fn wholly_reserved(cidr: &IpNet, reserved: &[IpNet]) -> bool {
    reserved.iter().any(|r| r.masked().covers(cidr))
}

/// A reservation entry: a CIDR, or a bare address meaning /32 or /128.
fn parse_cidr_or_ip(s: &str) -> Option<IpNet> {
    s.parse::<IpNet>()
        .ok()
        .or_else(|| s.parse::<IpAddr>().ok().map(IpNet::host))
}
