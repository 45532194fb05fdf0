//! The owners of an allocation (libcalico-go `ipam_attributes.go`): an address's attribute
//! entry holds its active owner (`secondary`, the pod using it) and, for a KubeVirt VM's
//! persistent address, an alternate owner (`alternateOwnerAttrs`, the live-migration
//! target). Both are changed together with a block compare-and-swap, optionally only when
//! they still name an expected pod.

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::datastore::model::{AllocationAttribute, AllocationBlock};
use crate::ipam::block::sanitize_handle;

/// The attribute keys that name an owner pod.
pub const ATTR_POD: &str = "pod";
pub const ATTR_NAMESPACE: &str = "namespace";

/// An owner pod, as an allocation's attributes name it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owner {
    pub namespace: String,
    pub pod: String,
}

impl Owner {
    /// Whether `attrs` name this pod (upstream's `AttributeOwner.Matches`): both keys there
    /// and equal. The empty owner matches attributes that are absent or empty.
    pub fn matches(&self, attrs: Option<&BTreeMap<String, String>>) -> bool {
        let attrs = attrs.filter(|a| !a.is_empty());
        if self.pod.is_empty() && self.namespace.is_empty() {
            return attrs.is_none();
        }
        attrs.is_some_and(|a| {
            a.get(ATTR_POD) == Some(&self.pod) && a.get(ATTR_NAMESPACE) == Some(&self.namespace)
        })
    }

    fn described(attrs: Option<&BTreeMap<String, String>>) -> String {
        let get = |k| attrs.and_then(|a| a.get(k)).map_or("", String::as_str);
        format!("pod={} namespace={}", get(ATTR_POD), get(ATTR_NAMESPACE))
    }
}

/// What to do to one owner.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Change {
    #[default]
    Keep,
    Set(BTreeMap<String, String>),
    Clear,
}

/// Changes to both owners, each made only if its precondition holds.
#[derive(Clone, Debug, Default)]
pub struct OwnerUpdate {
    pub active: Change,
    pub alternate: Change,
    /// The active owner must be this pod (or, the empty owner, none).
    pub expect_active: Option<Owner>,
    pub expect_alternate: Option<Owner>,
}

/// Why the owners of an address were not changed.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OwnerError {
    /// Upstream's `ErrorResourceDoesNotExist` for an unassigned address.
    #[error("resource does not exist: {0} with error: IP is unassigned")]
    Unassigned(IpAddr),
    #[error("IP {ip} is not assigned to handle {handle}")]
    OtherHandle { ip: IpAddr, handle: String },
    /// A precondition failed (upstream's `ErrorResourceUpdateConflict`).
    #[error("update conflict: {ip}: cannot set {field}: expected {expected} but found {found}")]
    Precondition {
        ip: IpAddr,
        field: &'static str,
        expected: String,
        found: String,
    },
}

/// The two owners of an allocation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Owners {
    pub active: Option<BTreeMap<String, String>>,
    pub alternate: Option<BTreeMap<String, String>>,
}

impl Owners {
    /// Whether either owner is set.
    pub fn any(&self) -> bool {
        [&self.active, &self.alternate]
            .into_iter()
            .any(|o| o.as_ref().is_some_and(|m| !m.is_empty()))
    }
}

impl AllocationBlock {
    fn attribute_of(&self, ip: &IpAddr) -> Option<(usize, &AllocationAttribute)> {
        let index = self
            .allocations
            .get(self.ordinal_of(ip)?)
            .copied()
            .flatten()?;
        self.attributes
            .as_ref()
            .and_then(|a| a.get(index))
            .map(|a| (index, a))
    }

    /// The owners of `ip`, or `None` when it is not allocated.
    pub fn owners_of(&self, ip: &IpAddr) -> Option<Owners> {
        self.attribute_of(ip).map(|(_, a)| Owners {
            active: a.secondary.clone(),
            alternate: a.alternate_owner_attrs.clone(),
        })
    }

    /// Applies `update` to `ip`'s owners (every precondition checked before any change).
    /// The attribute entry is changed in place, as upstream: every address sharing it (the
    /// same handle and owners) changes with it.
    pub fn set_owners(
        &mut self,
        ip: &IpAddr,
        handle: &str,
        update: &OwnerUpdate,
    ) -> Result<(), OwnerError> {
        let (index, attr) = self.attribute_of(ip).ok_or(OwnerError::Unassigned(*ip))?;
        let held = attr.handle_id.as_deref().map(sanitize_handle);
        if held != Some(handle) {
            return Err(OwnerError::OtherHandle {
                ip: *ip,
                handle: handle.to_string(),
            });
        }
        let checks = [
            (
                &update.active,
                &update.expect_active,
                attr.secondary.as_ref(),
                "ActiveOwnerAttrs",
            ),
            (
                &update.alternate,
                &update.expect_alternate,
                attr.alternate_owner_attrs.as_ref(),
                "AlternateOwnerAttrs",
            ),
        ];
        for (change, expected, current, field) in checks {
            if let (false, Some(want)) = (*change == Change::Keep, expected) {
                if !want.matches(current) {
                    return Err(OwnerError::Precondition {
                        ip: *ip,
                        field,
                        expected: format!("pod={} namespace={}", want.pod, want.namespace),
                        found: Owner::described(current),
                    });
                }
            }
        }
        let Some(attr) = self.attributes.as_mut().and_then(|a| a.get_mut(index)) else {
            return Err(OwnerError::Unassigned(*ip));
        };
        apply(&mut attr.secondary, &update.active);
        apply(&mut attr.alternate_owner_attrs, &update.alternate);
        Ok(())
    }

    /// The addresses `handle` holds in this block, with the block's mask, in ordinal order.
    pub fn addresses_of(&self, handle: &str) -> Vec<crate::support::net::IpNet> {
        self.ordinals_of(handle)
            .into_iter()
            .map(|o| crate::support::net::IpNet {
                addr: self.ip_of(o),
                prefix: self.cidr.prefix,
            })
            .collect()
    }
}

fn apply(slot: &mut Option<BTreeMap<String, String>>, change: &Change) {
    match change {
        Change::Keep => {}
        // An empty map is stored as absent (upstream's omitempty).
        Change::Set(m) => *slot = (!m.is_empty()).then(|| m.clone()),
        Change::Clear => *slot = None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn block() -> AllocationBlock {
        serde_json::from_value(json!({
            "cidr": "10.0.0.0/30", "affinity": "host:n1",
            "allocations": [0, null, 1, null], "unallocated": [1, 3],
            "attributes": [
                {"handle_id": "net.vmi.ns.vm", "secondary": {"pod": "p1", "namespace": "ns"}},
                {"handle_id": "net.c2"}
            ]
        }))
        .unwrap()
    }

    fn attrs(pod: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("pod".to_string(), pod.to_string()),
            ("namespace".to_string(), "ns".to_string()),
        ])
    }

    fn owner(pod: &str) -> Owner {
        Owner {
            namespace: "ns".into(),
            pod: pod.into(),
        }
    }

    #[test]
    fn set_with_and_without_preconditions() {
        let ip: IpAddr = "10.0.0.0".parse().unwrap();
        let mut b = block();
        assert_eq!(
            b.addresses_of("net.vmi.ns.vm")[0].to_string(),
            "10.0.0.0/30"
        );
        // The migration target becomes the alternate owner, unconditionally.
        let target = OwnerUpdate {
            alternate: Change::Set(attrs("p2")),
            ..Default::default()
        };
        b.set_owners(&ip, "net.vmi.ns.vm", &target).unwrap();
        let o = b.owners_of(&ip).unwrap();
        assert_eq!(o.active, Some(attrs("p1")));
        assert_eq!(o.alternate, Some(attrs("p2")));
        // Clearing the active owner only while it is still p1.
        let clear_p3 = OwnerUpdate {
            active: Change::Clear,
            expect_active: Some(owner("p3")),
            ..Default::default()
        };
        let err = b.set_owners(&ip, "net.vmi.ns.vm", &clear_p3).unwrap_err();
        assert_eq!(
            err.to_string(),
            "update conflict: 10.0.0.0: cannot set ActiveOwnerAttrs: expected pod=p3 namespace=ns but found pod=p1 namespace=ns"
        );
        let clear_p1 = OwnerUpdate {
            active: Change::Clear,
            expect_active: Some(owner("p1")),
            ..Default::default()
        };
        b.set_owners(&ip, "net.vmi.ns.vm", &clear_p1).unwrap();
        assert!(b.owners_of(&ip).unwrap().active.is_none());
        assert!(b.owners_of(&ip).unwrap().any());
        // The empty owner matches a cleared one.
        assert!(Owner::default().matches(None));
        assert!(!owner("p1").matches(None));
        // Wrong handle, unassigned address.
        assert!(matches!(
            b.set_owners(&"10.0.0.2".parse().unwrap(), "net.vmi.ns.vm", &target),
            Err(OwnerError::OtherHandle { .. })
        ));
        assert_eq!(
            b.set_owners(&"10.0.0.1".parse().unwrap(), "net.vmi.ns.vm", &target),
            Err(OwnerError::Unassigned("10.0.0.1".parse().unwrap()))
        );
    }
}
