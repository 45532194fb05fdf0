//! Pure allocation-block operations (no I/O), as libcalico-go's `allocationBlock`: assign
//! from the head of the `unallocated` FIFO, free to its tail, share one attribute per
//! (handle, owner) and compact attributes after a release, rewriting allocation indexes.
//! v3.32.1 semantics: a release frees at once (v3.32.1 has no release cooldown; an
//! attribute field it does not know, such as a later Calico's `releasedAt`, is kept as
//! written and means nothing here).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::datastore::model::{AllocationAttribute, AllocationBlock};
use crate::support::net::IpNet;

/// The handle Windows nodes use for their reserved addresses; such rows never make a block
/// non-empty.
pub const WINDOWS_RESERVED_HANDLE: &str = "windows-reserved-ipam-handle";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockError {
    #[error("Address already assigned in block")]
    AlreadyAssigned(IpAddr),
    #[error("IP {0} is not in block {1}")]
    NotInBlock(IpAddr, IpNet),
    /// AutoAssign into a block affine to another host (upstream prints host then type).
    #[error("Block affinity ({affinity}) does not match provided ({host}:host)")]
    AffinityMismatch { affinity: String, host: String },
    /// AssignIP (`IP=`) into a block affine to another host, with strict affinity.
    #[error("Block host affinity does not match")]
    HostAffinityMismatch,
    #[error("Attempt to assign from block {0} with no affinity")]
    NoAffinity(IpNet),
}

/// What a release by address did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReleaseOutcome {
    /// Addresses that were not allocated.
    pub unallocated: Vec<IpAddr>,
    /// How many addresses each handle lost.
    pub handles: Vec<(String, usize)>,
}

/// A handle as stored, cut at the first `\r` (upstream's `sanitizeHandle`).
pub(crate) fn sanitize_handle(h: &str) -> &str {
    h.split('\r').next().unwrap_or(h)
}

impl AllocationBlock {
    /// A freshly claimed block: every ordinal free, attributes `null`, sequence number = now.
    pub fn new_block(
        cidr: IpNet,
        host: Option<&str>,
        now_unix_nanos: u64,
        claim_time: Option<String>,
    ) -> AllocationBlock {
        let cidr = cidr.masked();
        let n = usize::try_from(cidr.num_addresses()).unwrap_or(usize::MAX);
        AllocationBlock {
            cidr,
            affinity: host.map(|h| format!("host:{h}")),
            affinity_claim_time: claim_time,
            allocations: vec![None; n],
            unallocated: (0..n).collect(),
            attributes: None,
            sequence_number: now_unix_nanos,
            sequence_number_for_allocation: Some(BTreeMap::new()),
            deleted: false,
            host_affinity: None,
            extra: Default::default(),
        }
    }

    pub fn ip_of(&self, ordinal: usize) -> IpAddr {
        self.cidr.nth(ordinal as u128)
    }

    pub fn ordinal_of(&self, ip: &IpAddr) -> Option<usize> {
        self.cidr
            .offset_of(ip)
            .and_then(|o| usize::try_from(o).ok())
            .filter(|o| *o < self.allocations.len())
    }

    fn reserved(&self, ordinal: usize, reserved: &[IpNet]) -> bool {
        let ip = self.ip_of(ordinal);
        reserved.iter().any(|r| r.contains(&ip))
    }

    /// Free addresses that are not reserved.
    pub fn num_free(&self, reserved: &[IpNet]) -> usize {
        if reserved.is_empty() {
            return self.unallocated.len();
        }
        self.unallocated
            .iter()
            .filter(|o| !self.reserved(**o, reserved))
            .count()
    }

    pub(crate) fn attribute(&self, index: usize) -> Option<&AllocationAttribute> {
        self.attributes.as_ref().and_then(|a| a.get(index))
    }

    /// No allocations other than Windows' reserved rows.
    pub fn is_empty(&self) -> bool {
        self.allocations.iter().flatten().all(|idx| {
            self.attribute(*idx)
                .and_then(|a| a.handle_id.as_deref())
                .is_some_and(|h| h == WINDOWS_RESERVED_HANDLE)
        })
    }

    /// Every block write increments the sequence number first.
    pub fn bump_sequence(&mut self) {
        self.sequence_number = self.sequence_number.wrapping_add(1);
    }

    fn check_affinity(&self, host: &str, strict: bool) -> Result<(), BlockError> {
        match &self.affinity {
            Some(a) if strict && a != &format!("host:{host}") => {
                Err(BlockError::AffinityMismatch {
                    affinity: a.clone(),
                    host: host.to_string(),
                })
            }
            None if strict => Err(BlockError::NoAffinity(self.cidr)),
            _ => Ok(()),
        }
    }

    /// The index of the attribute {handle, attrs}, reusing an identical one.
    fn find_or_add_attribute(
        &mut self,
        handle_id: &str,
        attrs: &BTreeMap<String, String>,
    ) -> usize {
        let want = AllocationAttribute {
            handle_id: Some(handle_id.to_string()),
            secondary: (!attrs.is_empty()).then(|| attrs.clone()),
            ..Default::default()
        };
        let list = self.attributes.get_or_insert_with(Vec::new);
        if let Some(i) = list.iter().position(|a| a == &want) {
            return i;
        }
        list.push(want);
        list.len() - 1
    }

    fn record_allocation(&mut self, ordinal: usize, attr: usize) {
        self.allocations[ordinal] = Some(attr);
        let seq = self.sequence_number;
        self.sequence_number_for_allocation
            .get_or_insert_with(BTreeMap::new)
            .insert(ordinal.to_string(), seq);
    }

    /// Takes up to `num` addresses from the head of the free list (skipping reserved ones,
    /// which stay in place). Returned with the block's mask, e.g. `10.0.0.5/26`.
    pub fn auto_assign(
        &mut self,
        num: usize,
        handle_id: &str,
        attrs: &BTreeMap<String, String>,
        host: &str,
        strict_affinity_check: bool,
        reserved: &[IpNet],
    ) -> Result<Vec<IpNet>, BlockError> {
        self.check_affinity(host, strict_affinity_check)?;
        let mut taken = Vec::new();
        for &o in &self.unallocated {
            if taken.len() == num {
                break;
            }
            if !self.reserved(o, reserved) {
                taken.push(o);
            }
        }
        if taken.is_empty() {
            return Ok(Vec::new());
        }
        let attr = self.find_or_add_attribute(handle_id, attrs);
        let chosen: BTreeSet<usize> = taken.iter().copied().collect();
        self.unallocated.retain(|o| !chosen.contains(o));
        let mut out = Vec::with_capacity(taken.len());
        for o in taken {
            self.record_allocation(o, attr);
            out.push(IpNet {
                addr: self.ip_of(o),
                prefix: self.cidr.prefix,
            });
        }
        Ok(out)
    }

    /// Assigns exactly `ip`.
    pub fn assign(
        &mut self,
        ip: IpAddr,
        handle_id: &str,
        attrs: &BTreeMap<String, String>,
        host: &str,
        strict_affinity_check: bool,
    ) -> Result<(), BlockError> {
        self.check_affinity(host, strict_affinity_check)
            .map_err(|e| match e {
                BlockError::AffinityMismatch { .. } => BlockError::HostAffinityMismatch,
                other => other,
            })?;
        let o = self
            .ordinal_of(&ip)
            .ok_or(BlockError::NotInBlock(ip, self.cidr))?;
        if self.allocations[o].is_some() {
            return Err(BlockError::AlreadyAssigned(ip));
        }
        let attr = self.find_or_add_attribute(handle_id, attrs);
        self.unallocated.retain(|x| *x != o);
        self.record_allocation(o, attr);
        Ok(())
    }

    /// Frees ordinals (ascending order kept by the caller) to the tail of the free list.
    fn free(&mut self, ordinals: &[usize], clear_sequence: bool) {
        for &o in ordinals {
            self.allocations[o] = None;
            self.unallocated.push(o);
            if clear_sequence {
                if let Some(m) = &mut self.sequence_number_for_allocation {
                    m.remove(&o.to_string());
                }
            }
        }
        self.compact_attributes();
    }

    /// Drops attributes no allocation points at, keeps the rest in order and rewrites the
    /// allocation indexes.
    fn compact_attributes(&mut self) {
        let Some(attrs) = self.attributes.take() else {
            return;
        };
        let used: BTreeSet<usize> = self.allocations.iter().flatten().copied().collect();
        let mut remap = BTreeMap::new();
        let mut kept = Vec::new();
        for (i, a) in attrs.into_iter().enumerate() {
            if used.contains(&i) {
                remap.insert(i, kept.len());
                kept.push(a);
            }
        }
        for slot in self.allocations.iter_mut().flatten() {
            if let Some(n) = remap.get(slot) {
                *slot = *n;
            }
        }
        self.attributes = Some(kept);
    }

    /// Whether any allocation belongs to `handle_id`.
    pub fn holds_handle(&self, handle_id: &str) -> bool {
        self.allocations.iter().flatten().any(|i| {
            self.attribute(*i)
                .and_then(|a| a.handle_id.as_deref())
                .is_some_and(|h| sanitize_handle(h) == handle_id)
        })
    }

    /// The ordinals allocated to `handle_id`, ascending.
    pub(crate) fn ordinals_of(&self, handle_id: &str) -> Vec<usize> {
        (0..self.allocations.len())
            .filter(|o| {
                self.allocations[*o]
                    .and_then(|i| self.attribute(i))
                    .and_then(|a| a.handle_id.as_deref())
                    .is_some_and(|h| sanitize_handle(h) == handle_id)
            })
            .collect()
    }

    /// Releases every address of `handle_id`; returns how many.
    pub fn release_by_handle(&mut self, handle_id: &str) -> usize {
        let ordinals = self.ordinals_of(handle_id);
        if !ordinals.is_empty() {
            self.free(&ordinals, false);
        }
        ordinals.len()
    }

    /// Releases specific addresses.
    /// With `only_handle`, an address allocated to any other handle is left alone and
    /// reported as not released.
    pub fn release_ips(&mut self, ips: &[IpAddr], only_handle: Option<&str>) -> ReleaseOutcome {
        let mut out = ReleaseOutcome::default();
        let mut ordinals = Vec::new();
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for ip in ips {
            let Some(o) = self.ordinal_of(ip) else {
                out.unallocated.push(*ip);
                continue;
            };
            match self.allocations[o] {
                None => out.unallocated.push(*ip),
                Some(idx) => {
                    let handle = self
                        .attribute(idx)
                        .and_then(|a| a.handle_id.as_deref())
                        .map(sanitize_handle);
                    if only_handle.is_some_and(|want| handle != Some(want)) {
                        out.unallocated.push(*ip);
                        continue;
                    }
                    if let Some(h) = handle {
                        *counts.entry(h.to_string()).or_insert(0) += 1;
                    }
                    if !ordinals.contains(&o) {
                        ordinals.push(o);
                    }
                }
            }
        }
        if !ordinals.is_empty() {
            self.free(&ordinals, true);
        }
        out.handles = counts.into_iter().collect();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(pod: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("node".to_string(), "node1".to_string()),
            ("pod".to_string(), pod.to_string()),
        ])
    }

    fn block29() -> AllocationBlock {
        AllocationBlock::new_block(
            "10.244.166.128/29".parse().unwrap(),
            Some("node1"),
            1000,
            Some("2025-01-02T03:04:05Z".into()),
        )
    }

    fn json(b: &AllocationBlock) -> String {
        serde_json::to_string(b).unwrap()
    }

    #[test]
    fn fresh_block_json() {
        assert_eq!(
            json(&block29()),
            r#"{"cidr":"10.244.166.128/29","affinity":"host:node1","affinity_claim_time":"2025-01-02T03:04:05Z","allocations":[null,null,null,null,null,null,null,null],"unallocated":[0,1,2,3,4,5,6,7],"attributes":null,"sequenceNumber":1000,"sequenceNumberForAllocation":{},"deleted":false}"#
        );
    }

    #[test]
    fn fill_to_the_last_address_and_empty_again() {
        let mut b = block29();
        let ips = b
            .auto_assign(1, "h0", &attrs("p0"), "node1", false, &[])
            .unwrap();
        assert_eq!(ips[0].to_string(), "10.244.166.128/29");
        b.bump_sequence();
        assert_eq!(
            json(&b),
            r#"{"cidr":"10.244.166.128/29","affinity":"host:node1","affinity_claim_time":"2025-01-02T03:04:05Z","allocations":[0,null,null,null,null,null,null,null],"unallocated":[1,2,3,4,5,6,7],"attributes":[{"handle_id":"h0","secondary":{"node":"node1","pod":"p0"}}],"sequenceNumber":1001,"sequenceNumberForAllocation":{"0":1000},"deleted":false}"#
        );
        for i in 1..8 {
            let got = b
                .auto_assign(
                    1,
                    &format!("h{i}"),
                    &attrs(&format!("p{i}")),
                    "node1",
                    true,
                    &[],
                )
                .unwrap();
            assert_eq!(got.len(), 1);
        }
        assert_eq!(b.num_free(&[]), 0);
        assert!(b
            .auto_assign(1, "hx", &attrs("px"), "node1", false, &[])
            .unwrap()
            .is_empty());
        assert_eq!(b.ip_of(7).to_string(), "10.244.166.135");
        // Release out of order: freed ordinals go to the tail in ascending order, attributes
        // are compacted and indexes rewritten.
        assert_eq!(b.release_by_handle("h5"), 1);
        assert_eq!(b.release_by_handle("h2"), 1);
        assert_eq!(b.unallocated, vec![5, 2]);
        assert_eq!(
            b.allocations,
            vec![
                Some(0),
                Some(1),
                None,
                Some(2),
                Some(3),
                None,
                Some(4),
                Some(5)
            ]
        );
        let handles: Vec<_> = b
            .attributes
            .as_ref()
            .unwrap()
            .iter()
            .map(|a| a.handle_id.clone().unwrap())
            .collect();
        assert_eq!(handles, ["h0", "h1", "h3", "h4", "h6", "h7"]);
        // The next assignment takes the head of the FIFO.
        let ip = b
            .auto_assign(1, "h9", &attrs("p9"), "node1", false, &[])
            .unwrap();
        assert_eq!(ip[0].addr.to_string(), "10.244.166.133");
        for h in ["h0", "h1", "h3", "h4", "h6", "h7", "h9", "h2"] {
            b.release_by_handle(h);
        }
        assert!(b.is_empty());
        assert_eq!(b.attributes, Some(vec![]));
        assert_eq!(b.allocations, vec![None; 8]);
        assert_eq!(b.unallocated.len(), 8);
    }

    #[test]
    fn attribute_reuse_and_specific_ip() {
        let mut b = block29();
        let two = b
            .auto_assign(2, "h", &attrs("p"), "node1", false, &[])
            .unwrap();
        assert_eq!(two.len(), 2);
        assert_eq!(b.attributes.as_ref().unwrap().len(), 1);
        assert_eq!(b.allocations[0], b.allocations[1]);
        let ip: IpAddr = "10.244.166.134".parse().unwrap();
        b.assign(ip, "h", &attrs("p"), "node1", false).unwrap();
        assert_eq!(b.attributes.as_ref().unwrap().len(), 1);
        assert_eq!(b.unallocated, vec![2, 3, 4, 5, 7]);
        assert_eq!(
            b.assign(ip, "other", &attrs("q"), "node1", false),
            Err(BlockError::AlreadyAssigned(ip))
        );
        assert_eq!(b.release_by_handle("h"), 3);
        assert_eq!(b.unallocated, vec![2, 3, 4, 5, 7, 0, 1, 6]);
    }

    #[test]
    fn reserved_addresses_are_skipped_in_place() {
        let mut b = block29();
        let reserved: Vec<IpNet> = vec!["10.244.166.128/31".parse().unwrap()];
        assert_eq!(b.num_free(&reserved), 6);
        let got = b
            .auto_assign(1, "h", &attrs("p"), "node1", false, &reserved)
            .unwrap();
        assert_eq!(got[0].addr.to_string(), "10.244.166.130");
        assert_eq!(b.unallocated, vec![0, 1, 3, 4, 5, 6, 7]);
    }

    #[test]
    fn strict_affinity() {
        let mut b = block29();
        let e = b
            .auto_assign(1, "h", &attrs("p"), "node2", true, &[])
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "Block affinity (host:node1) does not match provided (node2:host)"
        );
        // AssignIP's own text.
        assert_eq!(
            b.assign(
                "10.244.166.130".parse().unwrap(),
                "h",
                &attrs("p"),
                "node2",
                true
            )
            .unwrap_err()
            .to_string(),
            "Block host affinity does not match"
        );
        b.affinity = None;
        assert!(b
            .auto_assign(1, "h", &attrs("p"), "node2", true, &[])
            .is_err());
        assert!(b
            .auto_assign(1, "h", &attrs("p"), "node2", false, &[])
            .is_ok());
    }

    #[test]
    fn release_by_address_and_handle_counts() {
        let mut b = block29();
        b.auto_assign(2, "h1", &attrs("p"), "node1", false, &[])
            .unwrap();
        b.auto_assign(1, "h2\rjunk", &attrs("q"), "node1", false, &[])
            .unwrap();
        // Restricted to one handle, another handle's address is left alone.
        let mut only = b.clone();
        let out = only.release_ips(
            &[
                "10.244.166.128".parse().unwrap(),
                "10.244.166.130".parse().unwrap(),
            ],
            Some("h1"),
        );
        assert_eq!(
            out.unallocated,
            vec!["10.244.166.130".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(out.handles, vec![("h1".into(), 1)]);
        assert!(only.allocations[2].is_some());
        let out = b.release_ips(
            &[
                "10.244.166.128".parse().unwrap(),
                "10.244.166.130".parse().unwrap(),
                "10.244.166.133".parse().unwrap(),
            ],
            None,
        );
        assert_eq!(
            out.unallocated,
            vec!["10.244.166.133".parse::<IpAddr>().unwrap()]
        );
        assert_eq!(out.handles, vec![("h1".into(), 1), ("h2".into(), 1)]);
        assert_eq!(
            b.sequence_number_for_allocation
                .as_ref()
                .unwrap()
                .keys()
                .collect::<Vec<_>>(),
            ["1"]
        );
    }

    #[test]
    fn ipv6_block() {
        let mut b =
            AllocationBlock::new_block("fd00:10:244::/122".parse().unwrap(), Some("n"), 1, None);
        assert_eq!(b.allocations.len(), 64);
        let got = b.auto_assign(1, "h", &attrs("p"), "n", true, &[]).unwrap();
        assert_eq!(got[0].to_string(), "fd00:10:244::/122");
        assert_eq!(b.ip_of(63).to_string(), "fd00:10:244::3f");
    }
}
