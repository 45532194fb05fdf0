//! Deterministic tests of the allocator over the in-memory store: the claim protocol, the
//! handle bookkeeping and release, with injected datastore faults (lost races, lost answers,
//! unavailable writes) and deterministic interleavings of two callers (`YieldBeforeWrite`
//! under `tokio::join!`). Every test ends by checking the store's IPAM invariants: blocks and
//! handles agree, no address is held twice, every affinity is confirmed and backed by its
//! block.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::json;

use super::release::parse_affinity;
use super::*;
use crate::datastore::memory::{Fault, FaultRule, KeyClass, MemoryDatastore, WriteOp, WriteRecord};
use crate::datastore::model::{AllocationBlock, IpamHandle};
use crate::datastore::{to_value, Key, Kind};

const POOL: &str = "10.80.0.0/29";

fn net(s: &str) -> IpNet {
    s.parse().unwrap()
}

fn pool_block() -> IpNet {
    net(POOL)
}

/// Nodes node1 and node2, ClusterInformation, and one IP pool that is exactly one /29 block
/// (so every host walks to the same block). No IPAMConfig: the allocator creates it.
fn store() -> MemoryDatastore {
    store_with_pool(POOL, 29)
}

/// `store()` that also answers `create_and_update` as etcd does (one transaction).
fn transactional_store() -> MemoryDatastore {
    seed(MemoryDatastore::transactional(), POOL, 29)
}

fn store_with_pool(cidr: &str, block_size: u8) -> MemoryDatastore {
    seed(MemoryDatastore::new(), cidr, block_size)
}

fn seed(ds: MemoryDatastore, cidr: &str, block_size: u8) -> MemoryDatastore {
    for n in ["node1", "node2"] {
        ds.put_raw(
            &Key::resource(Kind::Node, None, n),
            &json!({"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":n},"spec":{}}),
        );
    }
    ds.put_raw(
        &Key::resource(Kind::IpPool, None, "pool1"),
        &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"pool1"},
                "spec":{"cidr":cidr,"blockSize":block_size}}),
    );
    ds.put_raw(
        &Key::resource(Kind::ClusterInformation, None, "default"),
        &json!({"kind":"ClusterInformation","apiVersion":"projectcalico.org/v3",
                "metadata":{"name":"default"},"spec":{"datastoreReady":true}}),
    );
    ds
}

fn args(handle: &str, host: &str, num4: usize) -> AutoAssignArgs {
    AutoAssignArgs {
        num4,
        handle_id: handle.to_string(),
        attrs: BTreeMap::from([("node".to_string(), host.to_string())]),
        ..Default::default()
    }
}

/// AutoAssign of `n` IPv4 addresses to `handle` on `host`; the addresses.
async fn assign(ds: &MemoryDatastore, host: &str, handle: &str, n: usize) -> Vec<IpNet> {
    let (v4, v6) = Ipam::new(ds, host)
        .auto_assign(&args(handle, host, n))
        .await
        .unwrap_or_else(|e| panic!("auto_assign {handle} on {host}: {e}"));
    assert!(v6.ips.is_empty());
    v4.ips
}

fn blocks(ds: &MemoryDatastore) -> Vec<AllocationBlock> {
    ds.dump()
        .into_iter()
        .filter(|kv| matches!(kv.key, Key::Block { .. }))
        .map(|kv| kv.decode().unwrap())
        .collect()
}

fn block(ds: &MemoryDatastore, cidr: IpNet) -> AllocationBlock {
    let kv = ds
        .peek(&Key::Block { cidr })
        .unwrap_or_else(|| panic!("no block {cidr}"));
    serde_json::from_value(kv).unwrap()
}

fn handles(ds: &MemoryDatastore) -> BTreeMap<String, IpamHandle> {
    ds.dump()
        .into_iter()
        .filter_map(|kv| match &kv.key {
            Key::Handle { id } => Some((id.clone(), kv.decode().unwrap())),
            _ => None,
        })
        .collect()
}

/// (address, handle) of every allocation in the store.
fn allocations(ds: &MemoryDatastore) -> Vec<(IpAddr, String)> {
    let mut out = Vec::new();
    for b in blocks(ds) {
        for (o, a) in b.allocations.iter().enumerate() {
            if let Some(i) = a {
                let attr = &b.attributes.as_ref().unwrap()[*i];
                out.push((b.ip_of(o), attr.handle_id.clone().unwrap_or_default()));
            }
        }
    }
    out
}

fn addrs(ips: &[IpNet]) -> Vec<IpAddr> {
    ips.iter().map(|n| n.addr).collect()
}

/// The IPAM invariants a correct allocator keeps whatever the faults.
fn assert_consistent(ds: &MemoryDatastore) {
    let mut counts: BTreeMap<String, BTreeMap<String, i64>> = BTreeMap::new();
    for b in blocks(ds) {
        let n = b.allocations.len();
        let mut seen = vec![false; n];
        for (o, a) in b.allocations.iter().enumerate() {
            if let Some(i) = a {
                seen[o] = true;
                let attrs = b.attributes.as_deref().unwrap_or_default();
                let attr = attrs
                    .get(*i)
                    .unwrap_or_else(|| panic!("{}: ordinal {o} points past attributes", b.cidr));
                let h = attr.handle_id.clone().unwrap_or_default();
                *counts
                    .entry(h)
                    .or_default()
                    .entry(b.cidr.to_string())
                    .or_insert(0) += 1;
            }
        }
        for &o in &b.unallocated {
            assert!(
                o < n && !seen[o],
                "{}: ordinal {o} both free and allocated, or listed twice",
                b.cidr
            );
            seen[o] = true;
        }
        assert!(seen.iter().all(|s| *s), "{}: an ordinal is lost", b.cidr);
        // Every block with an owner is backed by that owner's confirmed affinity.
        if let Some((kind, host)) = b.affinity.as_deref().and_then(parse_affinity) {
            let key = Key::BlockAffinity {
                host: host.into(),
                cidr: b.cidr,
                affinity_type: kind.into(),
            };
            let aff = ds
                .peek(&key)
                .unwrap_or_else(|| panic!("{}: owned by {host} without affinity", b.cidr));
            assert_eq!(aff["state"], "confirmed", "{}", b.cidr);
        }
    }
    let stored: BTreeMap<String, BTreeMap<String, i64>> = handles(ds)
        .into_iter()
        .map(|(id, h)| (id, h.block))
        .collect();
    assert_eq!(stored, counts, "handle counts disagree with the blocks");
    // Every affinity is confirmed and its block names the same owner.
    for kv in ds.dump() {
        if let Key::BlockAffinity {
            host,
            cidr,
            affinity_type,
        } = &kv.key
        {
            assert_eq!(kv.value["state"], "confirmed", "{:?}", kv.key);
            let b = block(ds, *cidr);
            assert_eq!(
                b.affinity.as_deref(),
                Some(format!("{affinity_type}:{host}").as_str()),
                "affinity without its block"
            );
        }
    }
}

/// The writes so far as (op, key class, affinity state when one was written).
fn write_trace(ds: &MemoryDatastore) -> Vec<(WriteOp, KeyClass, String)> {
    ds.write_log()
        .into_iter()
        .map(|r| {
            let state = match (&r.key, &r.value) {
                (Key::BlockAffinity { .. }, Some(v)) => v["state"].as_str().unwrap_or("").into(),
                _ => String::new(),
            };
            (r.op, KeyClass::of(&r.key), state)
        })
        .collect()
}

#[tokio::test]
async fn fresh_pool_claims_a_block_pending_then_confirmed() {
    let ds = store();
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert_eq!(ips, [net("10.80.0.0/29")]);
    use KeyClass::*;
    use WriteOp::*;
    let s = |x: &str| x.to_string();
    assert_eq!(
        write_trace(&ds),
        [
            // GetIPAMConfig stores the defaults.
            (Create, IpamConfig, s("")),
            // getPendingAffinity, then (no block yet) the affinity re-marked pending ...
            (Create, Affinity, s("pending")),
            (Update, Affinity, s("pending")),
            // ... the block created, then the affinity confirmed.
            (Create, Block, s("")),
            (Update, Affinity, s("confirmed")),
            // The handle first, then the block CAS.
            (Create, Handle, s("")),
            (Update, Block, s("")),
        ]
    );
    assert!(ds
        .write_log()
        .iter()
        .all(|r| r.applied && r.error.is_none()));

    // The stored objects, in upstream's shapes.
    let raw = ds.peek(&Key::Block { cidr: pool_block() }).unwrap();
    let fields: Vec<&str> = raw
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    assert_eq!(
        fields,
        [
            "cidr",
            "affinity",
            "affinity_claim_time",
            "allocations",
            "unallocated",
            "attributes",
            "sequenceNumber",
            "sequenceNumberForAllocation",
            "deleted"
        ]
    );
    assert_eq!(raw["cidr"], POOL);
    assert_eq!(raw["affinity"], "host:node1");
    assert!(raw["affinity_claim_time"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        raw["allocations"],
        json!([0, null, null, null, null, null, null, null])
    );
    assert_eq!(raw["unallocated"], json!([1, 2, 3, 4, 5, 6, 7]));
    assert_eq!(
        raw["attributes"],
        json!([{"handle_id":"h1","secondary":{"node":"node1"}}])
    );
    let seq = raw["sequenceNumber"].as_u64().unwrap();
    // The allocation records the sequence number the block had before the write.
    assert_eq!(raw["sequenceNumberForAllocation"], json!({"0": seq - 1}));
    assert_eq!(raw["deleted"], false);
    assert_eq!(
        ds.peek(&Key::host_affinity("node1", pool_block())),
        Some(json!({"state":"confirmed","deleted":false}))
    );
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:1},"deleted":false}))
    );
    assert_eq!(
        ds.peek(&Key::IpamConfig),
        Some(json!({"auto_allocate_blocks":true,"kubeVirtVMAddressPersistence":"Enabled"}))
    );
    assert_consistent(&ds);

    // The second address comes from the affine block: no claim writes.
    let before = ds.writes();
    assert_eq!(assign(&ds, "node1", "h2", 1).await, [net("10.80.0.1/29")]);
    let trace = write_trace(&ds);
    assert_eq!(
        trace[before as usize..],
        [(Create, Handle, s("")), (Update, Block, s(""))]
    );
    assert_consistent(&ds);
}

#[tokio::test]
async fn lost_race_on_the_block_create_is_retried() {
    let ds = store();
    // The block create loses a race (AlreadyExists, but no block there when re-read).
    ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(1)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips, [net("10.80.0.0/29")]);
    assert_eq!(allocations(&ds), [(ips[0].addr, "h1".to_string())]);
    assert_eq!(blocks(&ds).len(), 1);
    assert_consistent(&ds);
}

#[tokio::test]
async fn conflict_on_the_assigning_block_write_is_retried() {
    let ds = store();
    // Block write 1 creates the block, write 2 assigns into it: that one conflicts.
    ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(2)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(addrs(&ips), [net("10.80.0.0/32").addr]);
    assert_eq!(allocations(&ds), [(ips[0].addr, "h1".to_string())]);
    // The handle was incremented, undone (deleted) after the conflict, then created again.
    let handle_ops: Vec<WriteOp> = ds
        .write_log()
        .iter()
        .filter(|r| matches!(r.key, Key::Handle { .. }))
        .map(|r| r.op)
        .collect();
    assert_eq!(
        handle_ops,
        [WriteOp::Create, WriteOp::Delete, WriteOp::Create]
    );
    assert_consistent(&ds);
}

#[tokio::test]
async fn conflicts_on_the_affinity_writes_are_retried() {
    // The compare-and-swap updates (pending again, confirmed). The first affinity write is a
    // create: its lost race would leave the winner's affinity, which a fault cannot forge.
    for nth in 2..=3 {
        let ds = store();
        ds.inject(Fault::on(KeyClass::Affinity, Fault::ConflictOnWrite(nth)));
        let ips = assign(&ds, "node1", "h1", 1).await;
        assert!(ds.pending_faults().is_empty(), "affinity write {nth}");
        assert_eq!(ips, [net("10.80.0.0/29")], "affinity write {nth}");
        assert_consistent(&ds);
    }
}

#[tokio::test]
async fn unavailable_block_write_is_undone_and_retried() {
    let ds = store();
    // The assigning block write fails without being applied.
    ds.inject(Fault::on(KeyClass::Block, Fault::UnavailableOnWrite(2)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips, [net("10.80.0.0/29")]);
    assert_eq!(allocations(&ds), [(ips[0].addr, "h1".to_string())]);
    assert_consistent(&ds);
}

#[tokio::test]
async fn unavailable_handle_create_is_retried() {
    let ds = store();
    ds.inject(Fault::on(KeyClass::Handle, Fault::UnavailableOnWrite(1)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips, [net("10.80.0.0/29")]);
    assert_consistent(&ds);
}

#[tokio::test]
async fn lost_answer_on_the_handle_create_does_not_over_count() {
    let ds = store();
    ds.inject(Fault::on(KeyClass::Handle, Fault::LoseAnswerOfWrite(1)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips, [net("10.80.0.0/29")]);
    assert_consistent(&ds);
}

#[tokio::test]
async fn lost_answer_on_the_handle_update_does_not_over_count() {
    // The handle exists: the create is refused, the read-modify-write's update is applied
    // but its answer lost.
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    let next = ds.writes_to(KeyClass::Handle) + 2;
    ds.inject(Fault::on(KeyClass::Handle, Fault::LoseAnswerOfWrite(next)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips, [net("10.80.0.1/29")]);
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:2},"deleted":false}))
    );
    assert_consistent(&ds);
}

#[tokio::test]
async fn lost_answer_on_the_block_write_does_not_double_allocate() {
    let ds = store();
    ds.inject(Fault::on(KeyClass::Block, Fault::LoseAnswerOfWrite(2)));
    let ips = assign(&ds, "node1", "h1", 1).await;
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ips.len(), 1);
    assert_eq!(allocations(&ds), [(ips[0].addr, "h1".to_string())]);
    assert_consistent(&ds);
}

#[tokio::test]
async fn a_new_handle_and_its_block_are_one_write_on_a_transactional_store() {
    let ds = transactional_store();
    let first = assign(&ds, "node1", "h1", 1).await;
    let pair: Vec<WriteRecord> = ds
        .write_log()
        .into_iter()
        .filter(|r| matches!(r.key, Key::Block { .. } | Key::Handle { .. }))
        .collect();
    // The claim creates the block; then one transaction creates the handle and assigns.
    let shape: Vec<_> = pair
        .iter()
        .map(|r| (r.op, KeyClass::of(&r.key), r.created.clone()))
        .collect();
    assert_eq!(
        shape,
        [
            (WriteOp::Create, KeyClass::Block, None),
            (
                WriteOp::CreateAndUpdate,
                KeyClass::Block,
                Some(Key::Handle { id: "h1".into() })
            ),
        ]
    );
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:1},"deleted":false}))
    );
    // An existing handle (a second family, a re-ADD) is updated, not created again.
    let second = assign(&ds, "node1", "h1", 1).await;
    assert_eq!(addrs(&first), ["10.80.0.0".parse::<IpAddr>().unwrap()]);
    assert_eq!(addrs(&second), ["10.80.0.1".parse::<IpAddr>().unwrap()]);
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:2},"deleted":false}))
    );
    assert_consistent(&ds);
}

#[tokio::test]
async fn a_failed_handle_and_block_transaction_neither_leaks_nor_double_counts() {
    // The transaction (the block's second write) loses its race, loses its answer after
    // being applied, or is not applied at all. The ADD then either holds exactly what the
    // store says it holds, or fails and its DEL leaves nothing; the next ADD works.
    for fault in [
        Fault::ConflictOnWrite(2),
        Fault::LoseAnswerOfWrite(2),
        Fault::UnavailableOnWrite(2),
    ] {
        let ds = transactional_store();
        ds.inject(Fault::on(KeyClass::Block, fault));
        let first = Ipam::new(&ds, "node1")
            .auto_assign(&args("h1", "node1", 1))
            .await;
        assert!(ds.pending_faults().is_empty(), "{fault:?} did not fire");
        assert_consistent(&ds);
        match &first {
            Ok((v4, _)) if v4.ips.len() == 1 => {
                assert_eq!(
                    allocations(&ds),
                    [(v4.ips[0].addr, "h1".to_string())],
                    "{fault:?}"
                );
                assert_eq!(
                    ds.peek(&Key::Handle { id: "h1".into() }),
                    Some(json!({"block":{POOL:1},"deleted":false})),
                    "{fault:?}"
                );
            }
            _ => {
                assert!(allocations(&ds).iter().all(|(_, h)| h != "h1"), "{fault:?}");
            }
        }
        // A lost race and a lost answer both end in an assignment.
        if !matches!(fault, Fault::UnavailableOnWrite(_)) {
            assert!(
                matches!(&first, Ok((v4, _)) if v4.ips.len() == 1),
                "{fault:?}: {first:?}"
            );
        }
        del(&ds, "node1", "h1").await.unwrap();
        assert!(allocations(&ds).is_empty(), "{fault:?}");
        assert!(handles(&ds).is_empty(), "{fault:?}: {:?}", handles(&ds));
        let ips = assign(&ds, "node1", "h2", 1).await;
        assert_eq!(allocations(&ds), [(ips[0].addr, "h2".to_string())]);
        assert_consistent(&ds);
    }
}

/// The plugin's DEL: release by handle, a missing handle being success.
async fn del(ds: &MemoryDatastore, host: &str, handle: &str) -> Result<(), IpamError> {
    match Ipam::new(ds, host).release_by_handle(handle).await {
        Err(IpamError::Datastore(e)) if e.is_not_found() => Ok(()),
        other => other,
    }
}

/// `fault` moved `by` writes later.
fn shift(fault: Fault, by: u64) -> Fault {
    match fault {
        Fault::ConflictOnWrite(n) => Fault::ConflictOnWrite(n + by),
        Fault::LoseAnswerOfWrite(n) => Fault::LoseAnswerOfWrite(n + by),
        Fault::UnavailableOnWrite(n) => Fault::UnavailableOnWrite(n + by),
        Fault::YieldBeforeWrite(n) => Fault::YieldBeforeWrite(n + by),
    }
}

/// Every way one write of a fresh claim-and-assign can fail.
fn claim_faults() -> Vec<FaultRule> {
    let writes = [
        (KeyClass::IpamConfig, 1),
        (KeyClass::Affinity, 1),
        (KeyClass::Affinity, 2),
        (KeyClass::Affinity, 3),
        (KeyClass::Block, 1),
        (KeyClass::Block, 2),
        (KeyClass::Handle, 1),
    ];
    let mut out = Vec::new();
    for (class, n) in writes {
        for fault in [Fault::LoseAnswerOfWrite(n), Fault::UnavailableOnWrite(n)] {
            out.push(Fault::on(class, fault));
        }
    }
    out
}

#[tokio::test]
async fn a_failed_write_during_add_heals_after_del() {
    // Whichever write of the first ADD fails (applied or not), the ADD either succeeds or
    // fails; DEL (retried as kubelet would) then leaves no address and no handle behind, and
    // the next ADD on the host works and leaves a consistent store.
    for rule in claim_faults() {
        let ds = store();
        ds.inject(rule);
        let first = Ipam::new(&ds, "node1")
            .auto_assign(&args("h1", "node1", 1))
            .await;
        assert!(ds.pending_faults().is_empty(), "{rule:?} did not fire");
        let mut deleted = false;
        for _ in 0..3 {
            if del(&ds, "node1", "h1").await.is_ok() {
                deleted = true;
                break;
            }
        }
        assert!(deleted, "{rule:?}: DEL kept failing");
        assert!(
            allocations(&ds).is_empty(),
            "{rule:?} (ADD: {first:?}): {:?}",
            allocations(&ds)
        );
        assert!(handles(&ds).is_empty(), "{rule:?}: {:?}", handles(&ds));
        let ips = assign(&ds, "node1", "h2", 1).await;
        assert_eq!(ips.len(), 1, "{rule:?}");
        assert_eq!(
            allocations(&ds),
            [(ips[0].addr, "h2".to_string())],
            "{rule:?}"
        );
        assert_consistent(&ds);
    }
}

#[tokio::test]
async fn a_failed_write_during_del_heals_when_del_is_retried() {
    let faults = [
        Fault::ConflictOnWrite(1),
        Fault::LoseAnswerOfWrite(1),
        Fault::UnavailableOnWrite(1),
    ];
    for class in [KeyClass::Block, KeyClass::Handle] {
        for fault in faults {
            let ds = store();
            assign(&ds, "node1", "h1", 2).await;
            let other = assign(&ds, "node1", "other", 1).await;
            let rule = Fault::on(class, shift(fault, ds.writes_to(class)));
            ds.inject(rule);
            let mut attempts = 0;
            while del(&ds, "node1", "h1").await.is_err() {
                attempts += 1;
                assert!(attempts < 3, "{rule:?}: DEL kept failing");
            }
            assert!(ds.pending_faults().is_empty(), "{rule:?} did not fire");
            assert_eq!(
                allocations(&ds),
                [(other[0].addr, "other".to_string())],
                "{rule:?}"
            );
            assert_eq!(
                handles(&ds).keys().collect::<Vec<_>>(),
                ["other"],
                "{rule:?}"
            );
            assert_consistent(&ds);
        }
    }
}

#[tokio::test]
async fn lost_answer_on_assign_ip_does_not_leak() {
    let ds = store();
    assign(&ds, "node1", "h0", 1).await;
    let next = ds.writes_to(KeyClass::Block) + 1;
    ds.inject(Fault::on(KeyClass::Block, Fault::LoseAnswerOfWrite(next)));
    let ip: IpAddr = "10.80.0.5".parse().unwrap();
    let r = Ipam::new(&ds, "node1")
        .assign_ip(ip, "h1", &BTreeMap::new(), None)
        .await;
    assert!(ds.pending_faults().is_empty());
    if r.is_err() {
        // A failed ADD is followed by DEL.
        del(&ds, "node1", "h1").await.unwrap();
        assert!(
            allocations(&ds).iter().all(|(_, h)| h != "h1"),
            "{:?}",
            allocations(&ds)
        );
    }
    assert_consistent(&ds);
}

#[tokio::test]
async fn release_by_handle_frees_exactly_its_ordinals_and_deletes_it() {
    let ds = store();
    let h1 = assign(&ds, "node1", "h1", 2).await;
    let h2 = assign(&ds, "node1", "h2", 1).await;
    let h3 = assign(&ds, "node1", "h3", 1).await;
    assert_eq!(
        addrs(&[h1.clone(), h2.clone(), h3.clone()].concat()),
        addrs(&[
            net("10.80.0.0/32"),
            net("10.80.0.1/32"),
            net("10.80.0.2/32"),
            net("10.80.0.3/32")
        ])
    );
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:2},"deleted":false}))
    );
    Ipam::new(&ds, "node1")
        .release_by_handle("h1")
        .await
        .unwrap();
    let b = block(&ds, pool_block());
    assert_eq!(
        b.allocations,
        [None, None, Some(0), Some(1), None, None, None, None]
    );
    // Freed ordinals go to the tail of the free list; attributes are compacted.
    assert_eq!(b.unallocated, [4, 5, 6, 7, 0, 1]);
    let attr_handles: Vec<_> = b
        .attributes
        .unwrap()
        .iter()
        .map(|a| a.handle_id.clone().unwrap())
        .collect();
    assert_eq!(attr_handles, ["h2", "h3"]);
    assert_eq!(
        handles(&ds).keys().collect::<Vec<_>>(),
        ["h2", "h3"],
        "h1 deleted, the others kept"
    );
    // The block stays, affine (empty or not).
    assert_eq!(b.affinity.as_deref(), Some("host:node1"));
    // Releasing an unknown handle is NotFound and writes nothing.
    let before = ds.writes();
    let e = Ipam::new(&ds, "node1")
        .release_by_handle("h1")
        .await
        .unwrap_err();
    assert!(
        matches!(e, IpamError::Datastore(ref d) if d.is_not_found()),
        "{e}"
    );
    assert_eq!(ds.writes(), before);
    assert_consistent(&ds);
}

#[tokio::test]
async fn conflict_during_release_is_retried() {
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    assign(&ds, "node1", "h2", 1).await;
    let next = ds.writes_to(KeyClass::Block) + 1;
    ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(next)));
    // The handle decrement conflicts too.
    let next_h = ds.writes_to(KeyClass::Handle) + 1;
    ds.inject(Fault::on(KeyClass::Handle, Fault::ConflictOnWrite(next_h)));
    Ipam::new(&ds, "node1")
        .release_by_handle("h1")
        .await
        .unwrap();
    assert!(ds.pending_faults().is_empty());
    assert_eq!(
        allocations(&ds),
        [(net("10.80.0.1/32").addr, "h2".to_string())]
    );
    assert_eq!(handles(&ds).keys().collect::<Vec<_>>(), ["h2"]);
    assert_consistent(&ds);
}

#[tokio::test]
async fn release_races_a_borrower_in_the_same_block() {
    // node1 releases h1 while node2 borrows from node1's block: the release's block CAS
    // yields, node2's allocation lands first, the release conflicts, re-reads and retries.
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    assign(&ds, "node1", "h2", 1).await;
    let next = ds.writes_to(KeyClass::Block) + 1;
    ds.inject(Fault::on(KeyClass::Block, Fault::YieldBeforeWrite(next)));
    let node1 = Ipam::new(&ds, "node1");
    let node2 = Ipam::new(&ds, "node2");
    let a3 = args("h3", "node2", 1);
    let (released, borrowed) = tokio::join!(node1.release_by_handle("h1"), node2.auto_assign(&a3));
    released.unwrap();
    let borrowed = borrowed.unwrap().0.ips;
    assert!(ds.pending_faults().is_empty());
    // The release's first CAS failed on node2's write.
    let block_writes: Vec<_> = ds
        .write_log()
        .into_iter()
        .filter(|r| matches!(r.key, Key::Block { .. }))
        .skip(next as usize - 1)
        .map(|r| r.error.as_ref().is_some_and(DatastoreError::is_conflict))
        .collect();
    // In completion order: node2's borrow, the held-back release CAS, its retry.
    assert_eq!(block_writes, [false, true, false]);
    assert_eq!(addrs(&borrowed), [net("10.80.0.2/32").addr]);
    let mut held = allocations(&ds);
    held.sort();
    assert_eq!(
        held,
        [
            (net("10.80.0.1/32").addr, "h2".to_string()),
            (net("10.80.0.2/32").addr, "h3".to_string())
        ]
    );
    assert_consistent(&ds);
}

#[tokio::test]
async fn empty_non_affine_block_is_deleted_on_release() {
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    // node1 gives the (non-empty) block up: it stays, without affinity.
    Ipam::new(&ds, "node1")
        .release_block_affinity("host", "node1", pool_block(), false, None)
        .await
        .unwrap();
    let b = block(&ds, pool_block());
    assert_eq!(b.affinity, None);
    assert!(ds
        .peek(&Key::host_affinity("node1", pool_block()))
        .is_none());
    // Releasing its last address deletes it (compare-and-swap on its revision).
    Ipam::new(&ds, "node1")
        .release_by_handle("h1")
        .await
        .unwrap();
    assert!(blocks(&ds).is_empty());
    assert!(handles(&ds).is_empty());
    let last_block_write = ds
        .write_log()
        .into_iter()
        .rfind(|r| matches!(r.key, Key::Block { .. }))
        .unwrap();
    assert_eq!(last_block_write.op, WriteOp::Delete);
    assert_consistent(&ds);
}

#[tokio::test]
async fn empty_affine_block_is_kept_on_release() {
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    Ipam::new(&ds, "node1")
        .release_by_handle("h1")
        .await
        .unwrap();
    let b = block(&ds, pool_block());
    assert!(b.is_empty());
    assert_eq!(b.affinity.as_deref(), Some("host:node1"));
    assert!(handles(&ds).is_empty());
    assert_consistent(&ds);
}

#[tokio::test]
async fn two_hosts_racing_for_one_block_get_distinct_addresses() {
    // node1 yields just before creating the block; node2 claims it and assigns meanwhile.
    // node1's create then finds node2's block: it drops its pending affinity and borrows.
    let ds = store();
    ds.put_raw(
        &Key::IpamConfig,
        &to_value(&IpamConfig::defaults()).unwrap(),
    );
    ds.inject(Fault::on(KeyClass::Block, Fault::YieldBeforeWrite(1)));
    let (n1, n2) = (Ipam::new(&ds, "node1"), Ipam::new(&ds, "node2"));
    let (a1, a2) = (args("h1", "node1", 1), args("h2", "node2", 1));
    let (r1, r2) = tokio::join!(n1.auto_assign(&a1), n2.auto_assign(&a2));
    let (ip1, ip2) = (r1.unwrap().0.ips, r2.unwrap().0.ips);
    assert!(ds.pending_faults().is_empty());
    assert_eq!(ip2, [net("10.80.0.0/29")], "node2 won the block");
    assert_eq!(ip1, [net("10.80.0.1/29")], "node1 borrowed");
    assert_eq!(
        block(&ds, pool_block()).affinity.as_deref(),
        Some("host:node2")
    );
    // node1's create was made first (lower number) and lost: AlreadyExists, not applied.
    let creates: Vec<_> = ds
        .write_log()
        .into_iter()
        .filter(|r| matches!(r.key, Key::Block { .. }) && r.op == WriteOp::Create)
        .map(|r| (r.n, r.error.is_some_and(|e| e.is_already_exists())))
        .collect();
    assert_eq!(creates.len(), 2);
    assert!(creates[0].0 > creates[1].0 && !creates[0].1, "{creates:?}");
    assert!(creates[1].1, "{creates:?}");
    assert!(ds
        .peek(&Key::host_affinity("node1", pool_block()))
        .is_none());
    assert_consistent(&ds);
}

#[tokio::test]
async fn two_callers_racing_in_one_block_get_distinct_addresses() {
    // node1 owns the block; while its assigning CAS is held back, node2 borrows the same
    // ordinal and writes first. node1 conflicts, re-reads and takes the next one.
    let ds = store();
    assign(&ds, "node1", "h0", 1).await;
    let next = ds.writes_to(KeyClass::Block) + 1;
    ds.inject(Fault::on(KeyClass::Block, Fault::YieldBeforeWrite(next)));
    let (n1, n2) = (Ipam::new(&ds, "node1"), Ipam::new(&ds, "node2"));
    let (a1, a2) = (args("h1", "node1", 2), args("h2", "node2", 2));
    let (r1, r2) = tokio::join!(n1.auto_assign(&a1), n2.auto_assign(&a2));
    let (ip1, ip2) = (r1.unwrap().0.ips, r2.unwrap().0.ips);
    assert!(ds.pending_faults().is_empty());
    assert_eq!(
        addrs(&ip2),
        [net("10.80.0.1/32").addr, net("10.80.0.2/32").addr]
    );
    assert_eq!(
        addrs(&ip1),
        [net("10.80.0.3/32").addr, net("10.80.0.4/32").addr]
    );
    let mut all = allocations(&ds);
    all.sort();
    all.dedup_by_key(|(ip, _)| *ip);
    assert_eq!(all.len(), 5, "no address handed out twice");
    assert_consistent(&ds);
}

#[tokio::test]
async fn sequential_conflicts_never_hand_out_an_address_twice() {
    // Many callers, each hit by a conflict on its first block write: every address once.
    let ds = store_with_pool("10.81.0.0/28", 29);
    let mut got = Vec::new();
    for i in 0..12 {
        let host = if i % 2 == 0 { "node1" } else { "node2" };
        let next = ds.writes_to(KeyClass::Block) + 1;
        ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(next)));
        got.extend(addrs(&assign(&ds, host, &format!("h{i}"), 1).await));
        assert!(ds.pending_faults().is_empty());
    }
    let mut unique = got.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), got.len(), "{got:?}");
    assert_eq!(allocations(&ds).len(), 12);
    assert_consistent(&ds);
}

#[tokio::test]
async fn assign_ip_conflict_is_retried_without_over_counting() {
    let ds = store();
    assign(&ds, "node1", "h0", 1).await;
    let next = ds.writes_to(KeyClass::Block) + 1;
    ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(next)));
    let ip: IpAddr = "10.80.0.5".parse().unwrap();
    let got = Ipam::new(&ds, "node1")
        .assign_ip(ip, "h1", &BTreeMap::new(), None)
        .await
        .unwrap();
    assert_eq!(got, IpNet::host(ip));
    assert!(ds.pending_faults().is_empty());
    assert_eq!(
        ds.peek(&Key::Handle { id: "h1".into() }),
        Some(json!({"block":{POOL:1},"deleted":false}))
    );
    // The same address again is refused.
    let e = Ipam::new(&ds, "node1")
        .assign_ip(ip, "h2", &BTreeMap::new(), None)
        .await
        .unwrap_err();
    assert!(matches!(e, IpamError::AddressInUse(_)), "{e}");
    assert_consistent(&ds);
}

/// DEL's first attempt releases the address but fails on the handle's removal; the retry
/// finds the address released and the handle left, and a read of the handle that goes
/// unanswered there must fail the DEL (to be retried), never end it with the handle still
/// stored.
#[tokio::test]
async fn an_unanswered_handle_read_during_a_retried_del_fails_it() {
    let ds = store();
    assign(&ds, "node1", "h1", 1).await;
    let other = assign(&ds, "node1", "other", 1).await;
    // The handle's delete (its last write) fails: the address is released, the handle stays.
    let next = ds.writes_to(KeyClass::Handle) + 1;
    ds.inject(Fault::on(KeyClass::Handle, Fault::UnavailableOnWrite(next)));
    assert!(del(&ds, "node1", "h1").await.is_err());
    assert!(handles(&ds).contains_key("h1"));
    // The retry reads the handle (1st read), finds nothing of it in its block, and reads the
    // handle again to remove it: that read is not answered.
    ds.fail_read(KeyClass::Handle, ds.reads_of(KeyClass::Handle) + 2);
    let retried = del(&ds, "node1", "h1").await;
    assert!(
        ds.pending_read_faults().is_empty(),
        "the read fault did not fire"
    );
    assert!(
        retried.is_err() || !handles(&ds).contains_key("h1"),
        "DEL succeeded and left the handle: {:?}",
        handles(&ds)
    );
    // Retried again (as kubelet does), it finishes.
    let mut attempts = 0;
    while del(&ds, "node1", "h1").await.is_err() {
        attempts += 1;
        assert!(attempts < 3, "DEL kept failing");
    }
    assert_eq!(handles(&ds).keys().collect::<Vec<_>>(), ["other"]);
    assert_eq!(allocations(&ds), [(other[0].addr, "other".to_string())]);
    assert_consistent(&ds);
}

/// Two callers for one KubeVirt VM's handle (at most one address per IP version), the
/// first held back just before its block write: the second allocates; the first finds the
/// handle full, and gets the second's address rather than another. On a store that writes
/// the new handle and the block in one transaction (etcd) and on one that does not (KDD).
#[tokio::test]
async fn one_address_per_version_for_a_vm_handle_however_many_ask() {
    for ds in [store(), transactional_store()] {
        ds.put_raw(
            &Key::IpamConfig,
            &to_value(&IpamConfig::defaults()).unwrap(),
        );
        assign(&ds, "node1", "other", 1).await;
        let next = ds.writes_to(KeyClass::Block) + 1;
        ds.inject(Fault::on(KeyClass::Block, Fault::YieldBeforeWrite(next)));
        let vm = AutoAssignArgs {
            max_per_version: Some(1),
            ..args("net.vmi.ns.vm", "node1", 1)
        };
        let (a, b) = (Ipam::new(&ds, "node1"), Ipam::new(&ds, "node1"));
        let (r1, r2) = tokio::join!(a.auto_assign(&vm), b.auto_assign(&vm));
        let (ip1, ip2) = (r1.unwrap().0.ips, r2.unwrap().0.ips);
        assert_eq!(ip1, ip2);
        assert_eq!(ip1.len(), 1);
        let held: Vec<_> = allocations(&ds)
            .into_iter()
            .filter(|(_, h)| h == "net.vmi.ns.vm")
            .collect();
        assert_eq!(held.len(), 1, "{held:?}");
        assert_eq!(handles(&ds)["net.vmi.ns.vm"].block.values().sum::<i64>(), 1);
        // Asked again, the handle's address; `IP=` of another address is refused.
        let again = Ipam::new(&ds, "node1")
            .auto_assign(&vm)
            .await
            .unwrap()
            .0
            .ips;
        assert_eq!(again, ip1);
        let other: IpAddr = "10.80.0.6".parse().unwrap();
        let err = Ipam::new(&ds, "node1")
            .assign_ip(other, "net.vmi.ns.vm", &BTreeMap::new(), Some(1))
            .await
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "handle net.vmi.ns.vm already has IP(s) allocated, cannot assign additional IP 10.80.0.6 (maxAllocPerIPVersion=1)"
        );
        assert_consistent(&ds);
    }
}

/// With the IPAM lock file's journal (the Kubernetes datastore: no transaction), a new
/// handle and its block are written together; every fault of either write still ends
/// consistent, or (the outcome unknown) with the block pending in the journal, where the
/// DEL's release finds it.
mod journaled {
    use super::*;
    use crate::ipam::lock::IpamLock;

    struct Locked {
        _dir: crate::test_support::TempDir,
        lock: IpamLock,
    }

    async fn locked() -> Locked {
        let dir = crate::test_support::TempDir::new("journal");
        let path = dir.path().join("ipam.lock");
        let lock = IpamLock::acquire(path.to_str().unwrap()).await;
        Locked { _dir: dir, lock }
    }

    async fn assign_journaled(
        ds: &MemoryDatastore,
        l: &Locked,
        handle: &str,
    ) -> Result<Vec<IpNet>, IpamError> {
        let ipam = Ipam::new(ds, "node1");
        ipam.keep_journal(l.lock.journal());
        ipam.auto_assign(&args(handle, "node1", 1))
            .await
            .map(|(v4, _)| v4.ips)
    }

    fn handle_and_block_writes(ds: &MemoryDatastore) -> Vec<(WriteOp, KeyClass)> {
        ds.write_log()
            .iter()
            .filter(|r| matches!(r.key, Key::Block { .. } | Key::Handle { .. }))
            .map(|r| (r.op, KeyClass::of(&r.key)))
            .collect()
    }

    /// A scratch directory and the IPAM lock file's path in it.
    fn lock_file(name: &str) -> (crate::test_support::TempDir, String) {
        let dir = crate::test_support::TempDir::new(name);
        let path = dir.path().join("ipam.lock").to_string_lossy().into_owned();
        (dir, path)
    }

    /// One ADD's IPAM as the plugin makes it: the lock, the reads on its hint and copies.
    async fn assign_as_a_holder(ds: &MemoryDatastore, lock_file: &str, handle: &str) -> IpNet {
        let lock = IpamLock::acquire(lock_file).await;
        let ipam = Ipam::new(ds, "node1");
        ipam.keep_journal(lock.journal());
        let reads = ipam
            .read_view(lock.block_hint(), &lock.hinted_copies())
            .await;
        let (v4, _) = ipam
            .auto_assign_from(&args(handle, "node1", 1), reads)
            .await
            .unwrap();
        lock.remember_blocks(&ipam.assigned_blocks());
        v4.ips[0]
    }

    /// The next holder takes the block as this host last wrote it (`BlockCopies`) instead
    /// of reading it; a copy someone else has written past since costs a conflict and a
    /// read, and the address is still a free one.
    #[tokio::test]
    async fn the_next_holder_takes_the_block_as_written() {
        let ds = store();
        let (_dir, p) = lock_file("copies");
        let p = p.as_str();
        let first = assign_as_a_holder(&ds, p, "h1").await;
        let reads = ds.reads_of(KeyClass::Block);
        let second = assign_as_a_holder(&ds, p, "h2").await;
        assert_ne!(first, second);
        assert_eq!(ds.reads_of(KeyClass::Block), reads, "the block was read");
        // Another writer, without the lock's journal: the copy is behind.
        let (other, _) = Ipam::new(&ds, "node1")
            .auto_assign(&args("h3", "node1", 1))
            .await
            .unwrap();
        let reads = ds.reads_of(KeyClass::Block);
        let fourth = assign_as_a_holder(&ds, p, "h4").await;
        assert!(
            ds.reads_of(KeyClass::Block) > reads,
            "the conflict re-read the block"
        );
        let all = [first, second, other.ips[0], fourth];
        let distinct: std::collections::BTreeSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), 4, "{all:?}");
        assert_eq!(allocations(&ds).len(), 4);
        assert_consistent(&ds);
    }

    /// A block read before the lock was taken (DEL's first round trip) gives way to the copy
    /// a holder wrote since, which has the higher revision; a read newer than the copy
    /// (another writer's, without the journal) is kept, and so is a block not found.
    #[tokio::test]
    async fn a_read_made_before_the_lock_gives_way_to_a_newer_copy() {
        let ds = store();
        let (_dir, p) = lock_file("newer-copy");
        let p = p.as_str();
        assign_as_a_holder(&ds, p, "h1").await;
        let cidr = IpamLock::acquire(p).await.block_hint()[0];
        let ipam = Ipam::new(&ds, "node1");
        let early = ipam.get_block(cidr).await.unwrap();
        assign_as_a_holder(&ds, p, "h2").await;
        let lock = IpamLock::acquire(p).await;
        ipam.keep_journal(lock.journal());
        let (block, rev) = ipam.newer_copy(cidr, early.clone()).unwrap();
        assert!(block.holds_handle("h2"));
        assert_eq!(
            Some(rev),
            ipam.get_block(cidr).await.unwrap().map(|(_, r)| r)
        );
        // Another writer, without the journal: the read is the newer.
        Ipam::new(&ds, "node1")
            .auto_assign(&args("h3", "node1", 1))
            .await
            .unwrap();
        let (fresh, fresh_rev) = ipam.get_block(cidr).await.unwrap().unwrap();
        let (kept, kept_rev) = ipam
            .newer_copy(cidr, Some((fresh, fresh_rev.clone())))
            .unwrap();
        assert!(kept.holds_handle("h3"));
        assert_eq!(kept_rev, fresh_rev);
        assert!(ipam.newer_copy(cidr, None).is_none());
        // Without the journal (not locked), the read as it was.
        let unlocked = Ipam::new(&ds, "node1");
        let (_, rev) = unlocked.newer_copy(cidr, early.clone()).unwrap();
        assert_eq!(Some(rev), early.map(|(_, r)| r));
    }

    /// AutoAssign's reads made before the lock, completed under it (`complete_view`, the
    /// Kubernetes datastore's ADD): the hinted block is taken from the holders' copy, not
    /// read, and a listing of this host's affinities made before another holder claimed a
    /// block is asked again: the ADD assigns from that block and claims no other.
    #[tokio::test]
    async fn reads_made_before_the_lock_are_completed_under_it() {
        let ds = store_with_pool("10.80.0.0/27", 29);
        let (_dir, p) = lock_file("two-step");
        let p = p.as_str();
        assign_as_a_holder(&ds, p, "h0").await;
        let ipam = Ipam::new(&ds, "node1");
        // Read while other holders fill the block and claim the next one.
        let early = ipam.read_view_unlocked().await;
        let mut ips = Vec::new();
        for i in 1..=8 {
            ips.push(assign_as_a_holder(&ds, p, &format!("h{i}")).await);
        }
        let affine = |ds: &MemoryDatastore| {
            ds.dump()
                .into_iter()
                .filter(|kv| matches!(kv.key, Key::BlockAffinity { .. }))
                .count()
        };
        assert_eq!(affine(&ds), 2);
        let lock = IpamLock::acquire(p).await;
        ipam.keep_journal(lock.journal());
        let block_reads = ds.reads_of(KeyClass::Block);
        let lists = ds.affinity_lists();
        let reads = ipam
            .complete_view(early, lock.block_hint(), &lock.hinted_copies())
            .await;
        assert_eq!(
            ds.reads_of(KeyClass::Block),
            block_reads,
            "the hinted block was read"
        );
        assert_eq!(ds.affinity_lists(), lists + 1, "the listing was believed");
        let (v4, _) = ipam
            .auto_assign_from(&args("h9", "node1", 1), reads)
            .await
            .unwrap();
        ips.push(v4.ips[0]);
        assert_eq!(affine(&ds), 2, "another block was claimed");
        assert_eq!(
            ips.iter().collect::<std::collections::BTreeSet<_>>().len(),
            9
        );
        assert_consistent(&ds);
    }

    #[tokio::test]
    async fn both_writes_go_together_and_the_record_is_settled() {
        let ds = store();
        let l = locked().await;
        let ips = assign_journaled(&ds, &l, "h1").await.unwrap();
        assert_eq!(ips, [net("10.80.0.0/29")]);
        // The claim creates the block; then the handle's create and the block's update.
        assert_eq!(
            handle_and_block_writes(&ds),
            [
                (WriteOp::Create, KeyClass::Block),
                (WriteOp::Create, KeyClass::Handle),
                (WriteOp::Update, KeyClass::Block),
            ]
        );
        assert!(l.lock.pending_for("h1").is_empty());
        assert_consistent(&ds);
    }

    #[tokio::test]
    async fn every_fault_of_either_write_ends_consistent() {
        let faults = [
            Fault::on(KeyClass::Block, Fault::ConflictOnWrite(2)),
            Fault::on(KeyClass::Block, Fault::UnavailableOnWrite(2)),
            Fault::on(KeyClass::Block, Fault::LoseAnswerOfWrite(2)),
            Fault::on(KeyClass::Handle, Fault::ConflictOnWrite(1)),
            Fault::on(KeyClass::Handle, Fault::UnavailableOnWrite(1)),
            Fault::on(KeyClass::Handle, Fault::LoseAnswerOfWrite(1)),
        ];
        for fault in faults {
            let ds = store();
            let l = locked().await;
            ds.inject(fault);
            let ips = assign_journaled(&ds, &l, "h1")
                .await
                .unwrap_or_else(|e| panic!("{fault:?}: {e}"));
            assert!(ds.pending_faults().is_empty(), "{fault:?}");
            assert_eq!(ips.len(), 1, "{fault:?}");
            assert_eq!(
                allocations(&ds),
                [(ips[0].addr, "h1".to_string())],
                "{fault:?}"
            );
            assert!(l.lock.pending_for("h1").is_empty(), "{fault:?}");
            assert_consistent(&ds);
        }
    }

    /// The block lands, the handle's create fails and its re-read too (as a SIGKILL between
    /// them would leave it): the call fails, the block stays pending, and the release of the
    /// pending block (the DEL's) leaves nothing.
    #[tokio::test]
    async fn a_block_without_its_handle_stays_pending_until_released() {
        let ds = store();
        let l = locked().await;
        ds.inject(Fault::on(KeyClass::Handle, Fault::UnavailableOnWrite(1)));
        ds.fail_read(KeyClass::Handle, 1);
        let e = assign_journaled(&ds, &l, "h1").await.unwrap_err();
        assert!(!e.to_string().is_empty());
        let block = net("10.80.0.0/29");
        assert_eq!(l.lock.pending_for("h1"), [block]);
        assert_eq!(allocations(&ds).len(), 1);
        assert!(handles(&ds).is_empty());
        let ipam = Ipam::new(&ds, "node1");
        assert_eq!(ipam.release_in_block("h1", block).await.unwrap(), 1);
        l.lock.settle("h1");
        assert!(allocations(&ds).is_empty());
        assert_consistent(&ds);
    }

    /// A DEL's release as the calico-ipam driver makes it under the host's lock: the
    /// handle's addresses, then whatever the journal still has pending for it.
    async fn release_as_a_holder(
        ds: &MemoryDatastore,
        lock_file: &str,
        handle: &str,
    ) -> Result<(), IpamError> {
        let lock = IpamLock::acquire(lock_file).await;
        let ipam = Ipam::new(ds, "node1");
        ipam.keep_journal(lock.journal());
        let key = Key::Handle {
            id: handle.to_string(),
        };
        match ds.get(&key).await {
            Ok(kv) => ipam.release_read_handle(handle, kv).await?,
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        for cidr in lock.pending_for(handle) {
            ipam.release_in_block(handle, cidr).await?;
        }
        lock.settle(handle);
        Ok(())
    }

    /// Under the lock, the handle's delete goes out beside its block's write (the block
    /// write, made to wait, lands after it): one round trip; the journal's record for the
    /// pair is settled once both have landed.
    #[tokio::test]
    async fn a_del_deletes_the_handle_beside_the_block_write() {
        let ds = store();
        let (_dir, p) = lock_file("release-beside");
        let p = p.as_str();
        assign_as_a_holder(&ds, p, "h1").await;
        let kept = assign_as_a_holder(&ds, p, "h2").await;
        let next = ds.writes_to(KeyClass::Block) + 1;
        ds.inject(Fault::on(KeyClass::Block, Fault::YieldBeforeWrite(next)));
        let before = handle_and_block_writes(&ds).len();
        release_as_a_holder(&ds, p, "h1").await.unwrap();
        assert_eq!(
            handle_and_block_writes(&ds)[before..],
            [
                (WriteOp::Delete, KeyClass::Handle),
                (WriteOp::Update, KeyClass::Block)
            ]
        );
        assert_eq!(allocations(&ds), [(kept.addr, "h2".to_string())]);
        assert!(!std::fs::read_to_string(p).unwrap().contains("pending"));
        assert_consistent(&ds);
    }

    /// Every way one of the two writes can fail, or be lost with the call (a SIGKILL: the
    /// call ends there): no address is left without its handle or a journal record leading
    /// to it, and the retried DEL leaves nothing.
    #[tokio::test]
    async fn a_del_with_either_write_failed_is_finished_by_its_retry() {
        for class in [KeyClass::Handle, KeyClass::Block] {
            for fault in [
                Fault::UnavailableOnWrite(1),
                Fault::LoseAnswerOfWrite(1),
                Fault::ConflictOnWrite(1),
            ] {
                let what = format!("{class:?} {fault:?}");
                let ds = store();
                let (_dir, p) = lock_file("release-fault");
                let p = p.as_str();
                assign_as_a_holder(&ds, p, "h1").await;
                let kept = assign_as_a_holder(&ds, p, "h2").await;
                ds.inject(Fault::on(class, shift(fault, ds.writes_to(class))));
                let first = release_as_a_holder(&ds, p, "h1").await;
                assert!(ds.pending_faults().is_empty(), "{what}");
                let journal = std::fs::read_to_string(p).unwrap();
                let h1_left = allocations(&ds).iter().any(|(_, h)| h == "h1");
                let h1_handle = handles(&ds).contains_key("h1");
                if h1_left && !h1_handle {
                    assert!(
                        journal.lines().any(|l| l.starts_with("pending h1 ")),
                        "{what}: an address of h1 with neither its handle nor a record"
                    );
                }
                if first.is_ok() {
                    assert!(
                        !h1_left && !h1_handle,
                        "{what}: a DEL that succeeded left h1"
                    );
                }
                release_as_a_holder(&ds, p, "h1")
                    .await
                    .unwrap_or_else(|e| panic!("{what}: the retry failed: {e}"));
                assert_eq!(allocations(&ds), [(kept.addr, "h2".to_string())], "{what}");
                assert_eq!(
                    handles(&ds).into_keys().collect::<Vec<_>>(),
                    ["h2"],
                    "{what}"
                );
                assert!(
                    !std::fs::read_to_string(p).unwrap().contains("pending"),
                    "{what}"
                );
                assert_consistent(&ds);
            }
        }
    }
}
