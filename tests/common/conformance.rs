//! One conformance suite for every `Datastore` backend: the trait contract the IPAM and the
//! plugin rely on (error kinds and texts, create-if-absent, compare-and-swap update and
//! delete, per-object revisions, list filters, values read back as written).
//!
//! Backend-agnostic by construction: only IPAM keys (Block, BlockAffinity, Handle,
//! IpamConfig) and cluster-scoped resources (IPPool, ClusterInformation), which every backend
//! stores as given; never WorkloadEndpoint or Profile. Revisions are compared for equality
//! only (a Kubernetes resourceVersion is opaque). Each check uses names of its own and deletes
//! what it wrote, so checks can share one store and the suite can run twice on it; list checks
//! only look at their own objects. IPAMConfig is a singleton: its check saves and restores it.
#![allow(dead_code)]

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU32, Ordering};

use calico_cni::datastore::{Datastore, DatastoreError, Key, Kind, KvPair, ListKind};
use calico_cni::support::net::IpNet;
use futures::FutureExt;
use serde_json::{json, Value};

/// A check's outcome: `Err` says what did not hold.
pub type Check = Result<(), String>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn next() -> u32 {
    COUNTER.fetch_add(1, Ordering::SeqCst)
}

/// A name no other check (nor an earlier run in this process) uses; DNS-1123 safe.
fn unique(tag: &str) -> String {
    format!("conf-{tag}-{}-{}", std::process::id(), next())
}

/// A fresh IPv4 /26 (10.240.0.0/12, one per call).
fn unique_v4_block() -> IpNet {
    let n = next();
    let s = format!("10.{}.{}.0/26", 240 + ((n >> 8) & 0xf), n & 0xff);
    s.parse().expect("valid CIDR")
}

/// A fresh IPv6 /122.
fn unique_v6_block() -> IpNet {
    let s = format!("fd00:c0f:{:x}::/122", next());
    s.parse().expect("valid CIDR")
}

fn ok<T>(r: Result<T, DatastoreError>, what: &str) -> Result<T, String> {
    r.map_err(|e| format!("{what}: unexpected error: {e}"))
}

/// The error of a call that must fail.
fn err<T: std::fmt::Debug>(
    r: Result<T, DatastoreError>,
    what: &str,
) -> Result<DatastoreError, String> {
    match r {
        Ok(v) => Err(format!("{what}: succeeded ({v:?}), expected an error")),
        Err(e) => Ok(e),
    }
}

fn expect_not_found(e: &DatastoreError, key: &Key, what: &str) -> Check {
    match e {
        DatastoreError::NotFound { key: k, .. } if *k == key.describe() => {}
        other => {
            return Err(format!(
                "{what}: expected NotFound({}), got {other:?}",
                key.describe()
            ))
        }
    }
    let prefix = format!("resource does not exist: {} with error: ", key.describe());
    ensure!(
        e.to_string().starts_with(&prefix),
        "{what}: text {:?} does not start with {prefix:?}",
        e.to_string()
    );
    Ok(())
}

fn expect_already_exists(e: &DatastoreError, key: &Key, what: &str) -> Check {
    ensure!(
        matches!(e, DatastoreError::AlreadyExists(k) if *k == key.describe()),
        "{what}: expected AlreadyExists({}), got {e:?}",
        key.describe()
    );
    ensure!(
        e.to_string() == format!("resource already exists: {}", key.describe()),
        "{what}: text {:?}",
        e.to_string()
    );
    Ok(())
}

fn expect_conflict(e: &DatastoreError, key: &Key, what: &str) -> Check {
    ensure!(
        matches!(e, DatastoreError::Conflict(k) if *k == key.describe()),
        "{what}: expected Conflict({}), got {e:?}",
        key.describe()
    );
    Ok(())
}

/// Deletes `keys` (without revision), ignoring absence: a check's cleanup.
async fn cleanup<D: Datastore>(ds: &D, keys: &[Key]) {
    for k in keys {
        let _ = ds.delete(k, None).await;
    }
}

/// Runs `body`, then deletes `keys` whatever happened.
async fn with_cleanup<D, F>(ds: &D, keys: &[Key], body: F) -> Check
where
    D: Datastore,
    F: Future<Output = Check>,
{
    let r = AssertUnwindSafe(body)
        .catch_unwind()
        .await
        .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&p))));
    cleanup(ds, keys).await;
    r
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "(non-text panic)".into())
}

/// A block value with every field upstream writes set.
fn full_block(cidr: IpNet, host: &str) -> Value {
    json!({
        "cidr": cidr.to_string(),
        "affinity": format!("host:{host}"),
        "affinity_claim_time": "2025-01-02T03:04:05Z",
        "allocations": [0, null, 1, null],
        "unallocated": [1, 3],
        "attributes": [
            {"handle_id": "k8s-pod-network.a", "secondary": {"namespace": "ns1", "node": host, "pod": "pa", "timestamp": "2025-01-02 03:04:05.123456789 +0000 UTC"}},
            {"handle_id": "k8s-pod-network.b", "secondary": {"node": host}}
        ],
        "sequenceNumber": 1735787045000000001u64,
        "sequenceNumberForAllocation": {"0": 1735787045000000000u64, "2": 1735787045000000000u64},
        "deleted": false
    })
}

fn affinity(state: &str) -> Value {
    json!({"state": state, "deleted": false})
}

fn handle_value(cidr: IpNet, n: i64) -> Value {
    json!({"block": {cidr.to_string(): n}, "deleted": false})
}

fn ip_pool(name: &str, cidr: &str) -> Value {
    json!({
        "kind": "IPPool",
        "apiVersion": "projectcalico.org/v3",
        "metadata": {"name": name, "creationTimestamp": null},
        "spec": {"cidr": cidr, "ipipMode": "Never", "vxlanMode": "Always", "natOutgoing": true,
                 "blockSize": 26, "nodeSelector": "all()", "allowedUses": ["Workload", "Tunnel"]}
    })
}

fn cluster_information(name: &str) -> Value {
    json!({
        "kind": "ClusterInformation",
        "apiVersion": "projectcalico.org/v3",
        "metadata": {"name": name, "creationTimestamp": null},
        "spec": {"clusterGUID": "0123456789abcdef0123456789abcdef", "clusterType": "k8s,bgp",
                 "calicoVersion": "v3.32.1", "datastoreReady": true}
    })
}

/// A resource read back: kind, apiVersion, name and spec as written, and
/// `metadata.resourceVersion` equal to the pair's revision.
fn check_resource(kv: &KvPair, written: &Value, what: &str) -> Check {
    let v = &kv.value;
    for field in ["kind", "apiVersion", "spec"] {
        ensure!(
            v[field] == written[field],
            "{what}: {field} read back as {} (wrote {})",
            v[field],
            written[field]
        );
    }
    ensure!(
        v["metadata"]["name"] == written["metadata"]["name"],
        "{what}: name read back as {}",
        v["metadata"]["name"]
    );
    ensure!(
        v["metadata"]["resourceVersion"] == Value::String(kv.revision.clone()),
        "{what}: resourceVersion {} is not the revision {:?}",
        v["metadata"]["resourceVersion"],
        kv.revision
    );
    Ok(())
}

/// The objects of `list` whose keys are among `mine`.
fn only<'a>(list: &'a [KvPair], mine: &[Key]) -> Vec<&'a KvPair> {
    list.iter().filter(|kv| mine.contains(&kv.key)).collect()
}

fn same_keys(got: &[&KvPair], want: &[Key], what: &str) -> Check {
    let mut g: Vec<String> = got.iter().map(|kv| format!("{:?}", kv.key)).collect();
    let mut w: Vec<String> = want.iter().map(|k| format!("{k:?}")).collect();
    g.sort();
    w.sort();
    ensure!(g == w, "{what}: listed {g:?}, expected {w:?}");
    Ok(())
}

/// Each listed pair equals what `get` returns for its key.
async fn listed_as_get<D: Datastore>(ds: &D, listed: &[&KvPair], what: &str) -> Check {
    for kv in listed {
        let got = ok(ds.get(&kv.key).await, what)?;
        ensure!(
            got.value == kv.value && got.revision == kv.revision,
            "{what}: list gave {:?}@{} but get gives {:?}@{}",
            kv.value,
            kv.revision,
            got.value,
            got.revision
        );
    }
    Ok(())
}

// ------------------------------------------------------------------------- the checks

/// `get` of an absent key: `NotFound` naming `Key::describe()`, for every key type.
pub async fn get_absent_is_not_found<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let keys = [
        Key::Block { cidr },
        Key::host_affinity(&unique("host"), cidr),
        Key::Handle {
            id: unique("handle"),
        },
        Key::resource(Kind::IpPool, None, &unique("pool")),
        Key::resource(Kind::ClusterInformation, None, &unique("ci")),
    ];
    for k in &keys {
        let e = err(ds.get(k).await, &format!("get {k:?}"))?;
        expect_not_found(&e, k, &format!("get {k:?}"))?;
    }
    Ok(())
}

/// Create returns the revision `get` reports; a second create is `AlreadyExists` and
/// leaves the first value.
pub async fn create_then_already_exists<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let keys = vec![
        Key::Handle {
            id: unique("handle"),
        },
        Key::Block { cidr },
        Key::host_affinity(&unique("host"), cidr),
    ];
    let values = [
        handle_value(cidr, 1),
        full_block(cidr, "node1"),
        affinity("pending"),
    ];
    with_cleanup(ds, &keys, async {
        for (k, v) in keys.iter().zip(&values) {
            let what = format!("{k:?}");
            let rev = ok(ds.create(k, v).await, &format!("create {what}"))?;
            let kv = ok(ds.get(k).await, &format!("get {what}"))?;
            ensure!(
                kv.revision == rev,
                "{what}: create said {rev:?}, get says {:?}",
                kv.revision
            );
            ensure!(kv.key == *k, "{what}: get returned key {:?}", kv.key);
            let e = err(
                ds.create(k, &json!({"other": 1})).await,
                &format!("second create {what}"),
            )?;
            expect_already_exists(&e, k, &format!("second create {what}"))?;
            let again = ok(ds.get(k).await, &format!("get {what}"))?;
            ensure!(
                again.value == kv.value && again.revision == rev,
                "{what}: a failed create changed the object"
            );
        }
        Ok(())
    })
    .await
}

/// Update with the current revision succeeds with a new one; with a stale one it is a
/// `Conflict` that changes nothing; on an absent key it is `NotFound`.
pub async fn update_compare_and_swap<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let key = Key::Handle {
        id: unique("handle"),
    };
    let absent = Key::Block { cidr };
    let keys = vec![key.clone(), absent.clone()];
    with_cleanup(ds, &keys, async {
        let r1 = ok(ds.create(&key, &handle_value(cidr, 1)).await, "create")?;
        let r2 = ok(
            ds.update(&key, &handle_value(cidr, 2), &r1).await,
            "update at r1",
        )?;
        ensure!(r2 != r1, "update kept the revision {r1:?}");
        let kv = ok(ds.get(&key).await, "get after update")?;
        ensure!(
            kv.revision == r2 && kv.value == handle_value(cidr, 2),
            "get after update: {:?}@{}",
            kv.value,
            kv.revision
        );
        let e = err(
            ds.update(&key, &handle_value(cidr, 3), &r1).await,
            "update at stale r1",
        )?;
        expect_conflict(&e, &key, "update at stale r1")?;
        let kv = ok(ds.get(&key).await, "get after conflict")?;
        ensure!(
            kv.revision == r2 && kv.value == handle_value(cidr, 2),
            "a conflicting update changed the object"
        );
        let e = err(
            ds.update(&absent, &full_block(cidr, "n"), &r2).await,
            "update of absent",
        )?;
        expect_not_found(&e, &absent, "update of absent")?;
        ensure!(
            ds.get(&absent).await.is_err(),
            "an update of an absent key created it"
        );
        Ok(())
    })
    .await
}

/// Delete with a stale revision is a `Conflict` that keeps the object; with the current one
/// or none it deletes; an absent key is `NotFound` either way.
pub async fn delete_semantics<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let host = unique("host");
    let a = Key::host_affinity(&host, cidr);
    let b = Key::Block { cidr };
    let keys = vec![a.clone(), b.clone()];
    with_cleanup(ds, &keys, async {
        let r1 = ok(ds.create(&a, &affinity("pending")).await, "create")?;
        let r2 = ok(ds.update(&a, &affinity("confirmed"), &r1).await, "update")?;
        let e = err(ds.delete(&a, Some(&r1)).await, "delete at stale revision")?;
        expect_conflict(&e, &a, "delete at stale revision")?;
        ok(ds.get(&a).await, "get after a conflicting delete")?;
        ok(ds.delete(&a, Some(&r2)).await, "delete at current revision")?;
        let e = err(ds.get(&a).await, "get after delete")?;
        expect_not_found(&e, &a, "get after delete")?;
        let e = err(ds.delete(&a, None).await, "delete of absent")?;
        expect_not_found(&e, &a, "delete of absent")?;
        let e = err(
            ds.delete(&a, Some(&r2)).await,
            "delete of absent at a revision",
        )?;
        expect_not_found(&e, &a, "delete of absent at a revision")?;
        ok(
            ds.create(&b, &full_block(cidr, &host)).await,
            "create block",
        )?;
        ok(ds.delete(&b, None).await, "delete without revision")?;
        let e = err(ds.get(&b).await, "get after unconditional delete")?;
        expect_not_found(&e, &b, "get after unconditional delete")?;
        Ok(())
    })
    .await
}

/// Every write gives the object a revision it never had; a write to another object does not
/// move it (CAS is per object); a re-created object does not get an old revision back.
pub async fn revision_moves_on_every_write<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let a = Key::Handle {
        id: unique("handle"),
    };
    let b = Key::Handle {
        id: unique("handle"),
    };
    let keys = vec![a.clone(), b.clone()];
    with_cleanup(ds, &keys, async {
        let mut seen = vec![ok(ds.create(&a, &handle_value(cidr, 1)).await, "create")?];
        for n in 2..5 {
            let last = seen.last().cloned().unwrap_or_default();
            let r = ok(ds.update(&a, &handle_value(cidr, n), &last).await, "update")?;
            ensure!(
                !seen.contains(&r),
                "update {n} reused revision {r:?} ({seen:?})"
            );
            seen.push(r);
        }
        // Writing another object leaves a's revision, and a CAS at it still works.
        let rb = ok(ds.create(&b, &handle_value(cidr, 1)).await, "create other")?;
        ok(
            ds.update(&b, &handle_value(cidr, 2), &rb).await,
            "update other",
        )?;
        let last = seen.last().cloned().unwrap_or_default();
        let kv = ok(ds.get(&a).await, "get")?;
        ensure!(
            kv.revision == last,
            "another object's write moved the revision"
        );
        let r = ok(
            ds.update(&a, &handle_value(cidr, 9), &last).await,
            "update after other writes",
        )?;
        seen.push(r.clone());
        // Delete and re-create: a new revision, and the old one no longer matches.
        ok(ds.delete(&a, Some(&r)).await, "delete")?;
        let again = ok(ds.create(&a, &handle_value(cidr, 1)).await, "re-create")?;
        ensure!(
            !seen.contains(&again),
            "re-create reused revision {again:?} ({seen:?})"
        );
        let e = err(
            ds.update(&a, &handle_value(cidr, 2), &r).await,
            "update at pre-delete revision",
        )?;
        expect_conflict(&e, &a, "update at pre-delete revision")?;
        Ok(())
    })
    .await
}

/// Blocks list by IP version (and all of them without one), each as `get` reads it.
pub async fn list_blocks_by_version<D: Datastore>(ds: &D) -> Check {
    let host = unique("host");
    let v4 = [unique_v4_block(), unique_v4_block()];
    let v6 = unique_v6_block();
    let k4: Vec<Key> = v4.iter().map(|c| Key::Block { cidr: *c }).collect();
    let k6 = vec![Key::Block { cidr: v6 }];
    let all: Vec<Key> = k4.iter().chain(&k6).cloned().collect();
    with_cleanup(ds, &all, async {
        for k in &all {
            let Key::Block { cidr } = k else { continue };
            ok(
                ds.create(k, &full_block(*cidr, &host)).await,
                "create block",
            )?;
        }
        let l4 = ok(
            ds.list(&ListKind::Blocks { version: Some(4) }).await,
            "list v4",
        )?;
        same_keys(&only(&l4, &all), &k4, "blocks v4")?;
        let l6 = ok(
            ds.list(&ListKind::Blocks { version: Some(6) }).await,
            "list v6",
        )?;
        same_keys(&only(&l6, &all), &k6, "blocks v6")?;
        let la = ok(
            ds.list(&ListKind::Blocks { version: None }).await,
            "list all",
        )?;
        same_keys(&only(&la, &all), &all, "all blocks")?;
        ensure!(
            la.iter().all(|kv| matches!(kv.key, Key::Block { .. })),
            "a block list returned a non-block key"
        );
        listed_as_get(ds, &only(&la, &all), "blocks").await?;
        for kv in only(&la, &all) {
            let Key::Block { cidr } = kv.key else {
                continue;
            };
            ensure!(
                kv.value == full_block(cidr, &host),
                "block {cidr} listed as {}",
                kv.value
            );
        }
        Ok(())
    })
    .await
}

/// Affinities list by host, type and (optionally) version; another host whose name starts
/// with this one's is not included. The virtual affinity has a block of its own: on
/// Kubernetes an affinity's name is host and CIDR only (upstream's `parseKey`), so one host's
/// host and virtual affinities to one block would be one object (a block has one affinity).
pub async fn list_affinities_by_host_type_version<D: Datastore>(ds: &D) -> Check {
    let host = unique("host");
    let longer = format!("{host}0");
    let (c4a, c4b, c4v, c6) = (
        unique_v4_block(),
        unique_v4_block(),
        unique_v4_block(),
        unique_v6_block(),
    );
    let virt = |h: &str, c| Key::BlockAffinity {
        host: h.to_string(),
        cidr: c,
        affinity_type: "virtual".into(),
    };
    let host4 = vec![
        Key::host_affinity(&host, c4a),
        Key::host_affinity(&host, c4b),
    ];
    let host6 = vec![Key::host_affinity(&host, c6)];
    let virtual4 = vec![virt(&host, c4v)];
    let other = vec![Key::host_affinity(&longer, c4a)];
    let all: Vec<Key> = [&host4, &host6, &virtual4, &other]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
    let list = |h: &str, t: &str, v: Option<u8>| ListKind::Affinities {
        host: h.to_string(),
        affinity_type: t.to_string(),
        version: v,
    };
    with_cleanup(ds, &all, async {
        for k in &all {
            ok(
                ds.create(k, &affinity("confirmed")).await,
                &format!("create {k:?}"),
            )?;
        }
        let host_all: Vec<Key> = host4.iter().chain(&host6).cloned().collect();
        let cases = [
            (list(&host, "host", None), &host_all, "host, any version"),
            (list(&host, "host", Some(4)), &host4, "host, v4"),
            (list(&host, "host", Some(6)), &host6, "host, v6"),
            (list(&host, "virtual", None), &virtual4, "virtual"),
            (list(&longer, "host", None), &other, "the other host"),
        ];
        for (what, want, name) in cases {
            let got = ok(ds.list(&what).await, name)?;
            // A list by host is exact: every pair is ours.
            same_keys(&got.iter().collect::<Vec<_>>(), want, name)?;
            listed_as_get(ds, &got.iter().collect::<Vec<_>>(), name).await?;
            ensure!(
                got.iter().all(|kv| kv.value == affinity("confirmed")),
                "{name}: values {:?}",
                got.iter().map(|kv| &kv.value).collect::<Vec<_>>()
            );
        }
        Ok(())
    })
    .await
}

/// Handles list with their values; a deleted one is no longer listed.
pub async fn list_handles<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let keys: Vec<Key> = (0..2)
        .map(|_| Key::Handle {
            id: unique("handle"),
        })
        .collect();
    with_cleanup(ds, &keys, async {
        for (i, k) in keys.iter().enumerate() {
            ok(
                ds.create(k, &handle_value(cidr, i as i64 + 1)).await,
                "create handle",
            )?;
        }
        let l = ok(ds.list(&ListKind::Handles).await, "list handles")?;
        same_keys(&only(&l, &keys), &keys, "handles")?;
        listed_as_get(ds, &only(&l, &keys), "handles").await?;
        ok(ds.delete(&keys[0], None).await, "delete handle")?;
        let l = ok(
            ds.list(&ListKind::Handles).await,
            "list handles after delete",
        )?;
        same_keys(&only(&l, &keys), &keys[1..], "handles after delete")?;
        Ok(())
    })
    .await
}

/// IP pools list (all, and by name prefix) with `resourceVersion` filled from the revision.
pub async fn list_ip_pools<D: Datastore>(ds: &D) -> Check {
    // The trailing dash keeps `…-1-` from matching another check's `…-12-…`.
    let prefix = format!("{}-", unique("pool"));
    let names = [format!("{prefix}a"), format!("{prefix}b")];
    let keys: Vec<Key> = names
        .iter()
        .map(|n| Key::resource(Kind::IpPool, None, n))
        .collect();
    let cidrs = ["10.239.0.0/24", "10.239.1.0/24"];
    with_cleanup(ds, &keys, async {
        for ((k, n), c) in keys.iter().zip(&names).zip(cidrs) {
            ok(ds.create(k, &ip_pool(n, c)).await, "create pool")?;
        }
        let all = ListKind::Resources {
            kind: Kind::IpPool,
            namespace: None,
            name_prefix: None,
        };
        let l = ok(ds.list(&all).await, "list pools")?;
        same_keys(&only(&l, &keys), &keys, "pools")?;
        let by_prefix = ListKind::Resources {
            kind: Kind::IpPool,
            namespace: None,
            name_prefix: Some(prefix.clone()),
        };
        let lp = ok(ds.list(&by_prefix).await, "list pools by prefix")?;
        same_keys(
            &lp.iter().collect::<Vec<_>>(),
            &keys,
            "pools by name prefix",
        )?;
        for (kv, (n, c)) in only(&l, &keys).into_iter().zip(names.iter().zip(cidrs)) {
            check_resource(kv, &ip_pool(n, c), &format!("listed pool {n}"))?;
        }
        listed_as_get(ds, &only(&l, &keys), "pools").await?;
        Ok(())
    })
    .await
}

/// Block, handle and affinity values are read back exactly as written (every block field,
/// big sequence numbers, nulls in allocations), also after an update.
pub async fn ipam_values_round_trip<D: Datastore>(ds: &D) -> Check {
    let cidr = unique_v4_block();
    let cidr6 = unique_v6_block();
    let host = unique("host");
    let mut released = full_block(cidr6, &host);
    released["affinity"] = Value::Null;
    released["attributes"] = json!([]);
    released["allocations"] = json!([null, null, null, null]);
    released["unallocated"] = json!([3, 0, 2, 1]);
    released["sequenceNumberForAllocation"] = json!({});
    let pairs = vec![
        (Key::Block { cidr }, full_block(cidr, &host)),
        (Key::Block { cidr: cidr6 }, released),
        (Key::host_affinity(&host, cidr), affinity("pending")),
        (
            Key::BlockAffinity {
                host: host.clone(),
                cidr: cidr6,
                affinity_type: "virtual".into(),
            },
            affinity("confirmed"),
        ),
        (
            Key::Handle {
                id: unique("handle"),
            },
            json!({"block": {cidr.to_string(): 2, cidr6.to_string(): 1}, "deleted": false}),
        ),
    ];
    let keys: Vec<Key> = pairs.iter().map(|(k, _)| k.clone()).collect();
    with_cleanup(ds, &keys, async {
        for (k, v) in &pairs {
            let rev = ok(ds.create(k, v).await, &format!("create {k:?}"))?;
            let kv = ok(ds.get(k).await, &format!("get {k:?}"))?;
            ensure!(kv.value == *v, "{k:?}: wrote {v}, read {}", kv.value);
            // After an update too.
            let mut changed = v.clone();
            if let Some(obj) = changed.as_object_mut() {
                obj.insert("deleted".into(), Value::Bool(false));
            }
            if let Key::Block { .. } = k {
                changed["sequenceNumber"] = json!(1735787045000000002u64);
            }
            if let Key::BlockAffinity { .. } = k {
                changed["state"] = json!("pendingDeletion");
            }
            ok(ds.update(k, &changed, &rev).await, &format!("update {k:?}"))?;
            let kv = ok(ds.get(k).await, &format!("get {k:?} after update"))?;
            ensure!(
                kv.value == changed,
                "{k:?}: updated to {changed}, read {}",
                kv.value
            );
        }
        Ok(())
    })
    .await
}

/// IPAMConfig: NotFound text, create, read back, update, delete (the stored one, if any, is
/// put back afterwards).
pub async fn ipam_config_round_trip<D: Datastore>(ds: &D) -> Check {
    let key = Key::IpamConfig;
    let saved = match ds.get(&key).await {
        Ok(kv) => {
            ok(
                ds.delete(&key, Some(&kv.revision)).await,
                "set aside the stored IPAMConfig",
            )?;
            Some(kv.value)
        }
        Err(e) if e.is_not_found() => None,
        Err(e) => return Err(format!("get IPAMConfig: {e}")),
    };
    let r = with_cleanup(ds, std::slice::from_ref(&key), async {
        let e = err(ds.get(&key).await, "get absent IPAMConfig")?;
        expect_not_found(&e, &key, "get absent IPAMConfig")?;
        ensure!(
            e.to_string()
                .starts_with("resource does not exist: IPAMConfigKey() with error: "),
            "IPAMConfig NotFound text {:?}",
            e.to_string()
        );
        let v = json!({"strict_affinity": true, "auto_allocate_blocks": true,
                       "maxBlocksPerHost": 7, "kubeVirtVMAddressPersistence": "Enabled"});
        let rev = ok(ds.create(&key, &v).await, "create IPAMConfig")?;
        let kv = ok(ds.get(&key).await, "get IPAMConfig")?;
        ensure!(
            kv.value == v && kv.revision == rev,
            "IPAMConfig read back as {}",
            kv.value
        );
        let e = err(ds.create(&key, &v).await, "second create")?;
        expect_already_exists(&e, &key, "second create of IPAMConfig")?;
        let v2 = json!({"auto_allocate_blocks": true, "kubeVirtVMAddressPersistence": "Enabled"});
        let rev2 = ok(ds.update(&key, &v2, &rev).await, "update IPAMConfig")?;
        let kv = ok(ds.get(&key).await, "get IPAMConfig after update")?;
        ensure!(
            kv.value == v2 && kv.revision == rev2,
            "IPAMConfig updated to {}",
            kv.value
        );
        let e = err(ds.update(&key, &v, &rev).await, "stale update")?;
        expect_conflict(&e, &key, "stale update of IPAMConfig")?;
        ok(ds.delete(&key, Some(&rev2)).await, "delete IPAMConfig")?;
        Ok(())
    })
    .await;
    if let Some(v) = saved {
        ok(ds.create(&key, &v).await, "restore the stored IPAMConfig")?;
    }
    r
}

/// IPPool and ClusterInformation: created, read back with `resourceVersion` = revision (a
/// `resourceVersion` in the written value is not what is read), updated with the value read
/// (which carries its resourceVersion), deleted.
pub async fn cluster_resources_round_trip<D: Datastore>(ds: &D) -> Check {
    let pool = unique("pool");
    let ci = unique("ci");
    let pairs = [
        (
            Key::resource(Kind::IpPool, None, &pool),
            ip_pool(&pool, "10.238.0.0/24"),
        ),
        (
            Key::resource(Kind::ClusterInformation, None, &ci),
            cluster_information(&ci),
        ),
    ];
    let keys: Vec<Key> = pairs.iter().map(|(k, _)| k.clone()).collect();
    with_cleanup(ds, &keys, async {
        for (k, v) in &pairs {
            let what = format!("{k:?}");
            let mut written = v.clone();
            written["metadata"]["resourceVersion"] = json!("12345");
            let rev = ok(ds.create(k, &written).await, &format!("create {what}"))?;
            let kv = ok(ds.get(k).await, &format!("get {what}"))?;
            ensure!(
                kv.revision == rev,
                "{what}: create said {rev:?}, get {:?}",
                kv.revision
            );
            check_resource(&kv, v, &what)?;
            let mut changed = kv.value.clone();
            match k {
                Key::Resource {
                    kind: Kind::IpPool, ..
                } => {
                    changed["spec"]["natOutgoing"] = json!(false);
                    changed["spec"]["disabled"] = json!(true);
                }
                _ => changed["spec"]["datastoreReady"] = json!(false),
            }
            let rev2 = ok(
                ds.update(k, &changed, &rev).await,
                &format!("update {what}"),
            )?;
            ensure!(rev2 != rev, "{what}: update kept the revision");
            let kv2 = ok(ds.get(k).await, &format!("get {what} after update"))?;
            check_resource(&kv2, &changed, &format!("{what} after update"))?;
            let e = err(ds.update(k, &changed, &rev).await, "stale update")?;
            expect_conflict(&e, k, &format!("stale update of {what}"))?;
            ok(ds.delete(k, Some(&rev2)).await, &format!("delete {what}"))?;
            let e = err(ds.get(k).await, "get after delete")?;
            expect_not_found(&e, k, &format!("get {what} after delete"))?;
        }
        Ok(())
    })
    .await
}

/// Every check, by name, with its outcome (for a backend that must skip or inspect some).
pub async fn run_each<D: Datastore>(ds: &D) -> Vec<(&'static str, Check)> {
    let mut out = Vec::new();
    macro_rules! run {
        ($($check:ident),* $(,)?) => {
            $(
                let r = AssertUnwindSafe($check(ds))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&p))));
                out.push((stringify!($check), r));
            )*
        };
    }
    run!(
        get_absent_is_not_found,
        create_then_already_exists,
        update_compare_and_swap,
        delete_semantics,
        revision_moves_on_every_write,
        list_blocks_by_version,
        list_affinities_by_host_type_version,
        list_handles,
        list_ip_pools,
        ipam_values_round_trip,
        ipam_config_round_trip,
        cluster_resources_round_trip,
    );
    out
}

/// Runs every check; panics listing all that failed.
pub async fn run_all<D: Datastore>(ds: &D) {
    let results = run_each(ds).await;
    let total = results.len();
    let failures: Vec<String> = results
        .into_iter()
        .filter_map(|(name, r)| r.err().map(|e| format!("  {name}: {e}")))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {total} datastore conformance checks failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
