//! An in-memory `Datastore` with the etcd backend's observable semantics, and deterministic
//! fault injection, for tests of the IPAM and the plugin without a server.
//!
//! Semantics (as `etcd.rs`): one global revision counter, bumped by every applied write and
//! returned in decimal; create-if-absent; compare-and-swap update and (optional) delete on an
//! object's revision; lists by the same etcd key prefixes, filtered and ordered the same way
//! (by key path); values stored as the JSON bytes etcd would hold (a resource without its
//! `resourceVersion`, which reads fill in from the revision).
//!
//! Faults are numbered over write calls (create, update, delete) from the store's creation,
//! counting from 1, either over all writes or over the writes to one [`KeyClass`]:
//!
//! ```
//! use calico_cni::datastore::memory::{Fault, KeyClass, MemoryDatastore};
//! let store = MemoryDatastore::new();
//! // The next write fails with Conflict and is not applied.
//! store.inject(Fault::ConflictOnWrite(store.writes() + 1));
//! // The second write to a block is applied, but its caller gets `Unavailable`.
//! store.inject(Fault::on(KeyClass::Block, Fault::LoseAnswerOfWrite(2)));
//! ```
//!
//! Reads can fail too: [`MemoryDatastore::fail_read`] makes the n-th `get` of a class of
//! key answer `Unavailable` (numbered over the gets of that class).
//!
//! A store made with [`MemoryDatastore::transactional`] also answers `create_and_update` as
//! etcd's transaction does (both writes or neither, at one revision). That pair is one write
//! call, numbered in the class of the updated key; a store made with `new` answers `None`
//! there, as the Kubernetes backend does, so its callers write the two keys one by one.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};

use serde_json::Value;

use super::etcd::{decode_value, encode_value, key_from_path, key_path, list_prefix};
use super::resources::set_resource_version;
use super::{Datastore, DatastoreError, Key, Kind, KvPair, ListKind, Revision};

/// What a fault does to the write it hits. `n` counts from 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The n-th write is not applied and fails as a lost race would: `Conflict` for an update,
    /// a delete or a `create_and_update` (its compare-and-swap lost), `AlreadyExists` for a
    /// create (etcd and Kubernetes never answer a create with a conflict).
    ConflictOnWrite(u64),
    /// The n-th write is applied (if it can be), but its caller gets `Unavailable`, as when
    /// the connection drops after the request reached the server.
    LoseAnswerOfWrite(u64),
    /// The n-th write is not applied and its caller gets `Unavailable`.
    UnavailableOnWrite(u64),
    /// The task making the n-th write yields once before the write is applied, so a future
    /// joined with it (`tokio::join!`) runs meanwhile: a deterministic interleaving of two
    /// callers. The write keeps its number; writes made meanwhile are numbered after it.
    YieldBeforeWrite(u64),
}

impl Fault {
    /// The fault, counting only writes to keys of `class`.
    pub fn on(class: KeyClass, fault: Fault) -> FaultRule {
        FaultRule {
            fault,
            class: Some(class),
        }
    }

    fn nth(self) -> u64 {
        match self {
            Fault::ConflictOnWrite(n)
            | Fault::LoseAnswerOfWrite(n)
            | Fault::UnavailableOnWrite(n)
            | Fault::YieldBeforeWrite(n) => n,
        }
    }
}

/// A fault and the writes it counts: all of them, or those to one class of key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FaultRule {
    pub fault: Fault,
    pub class: Option<KeyClass>,
}

impl From<Fault> for FaultRule {
    fn from(fault: Fault) -> Self {
        FaultRule { fault, class: None }
    }
}

/// The kinds of keys, for per-kind fault counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KeyClass {
    Resource(Kind),
    Block,
    Affinity,
    Handle,
    IpamConfig,
}

impl KeyClass {
    pub fn of(key: &Key) -> KeyClass {
        match key {
            Key::Resource { kind, .. } => KeyClass::Resource(*kind),
            Key::Block { .. } => KeyClass::Block,
            Key::BlockAffinity { .. } => KeyClass::Affinity,
            Key::Handle { .. } => KeyClass::Handle,
            Key::IpamConfig => KeyClass::IpamConfig,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WriteOp {
    Create,
    Update,
    Delete,
    /// `create_and_update`, recorded under the updated key (the created key is in
    /// [`WriteRecord::created`]).
    CreateAndUpdate,
}

/// One write call, as the store saw it.
#[derive(Clone, Debug)]
pub struct WriteRecord {
    /// The write's number (from 1, over all writes).
    pub n: u64,
    pub op: WriteOp,
    pub key: Key,
    /// The value given (`None` for a delete).
    pub value: Option<Value>,
    /// Whether the store changed.
    pub applied: bool,
    /// What the caller got back, when it was an error.
    pub error: Option<DatastoreError>,
    /// The key a `CreateAndUpdate` created (or would have).
    pub created: Option<Key>,
}

struct Entry {
    bytes: Vec<u8>,
    mod_revision: i64,
}

#[derive(Default)]
struct State {
    revision: i64,
    /// By etcd key path, so prefix scans and order are etcd's.
    objects: BTreeMap<String, Entry>,
    writes: u64,
    writes_by_class: HashMap<KeyClass, u64>,
    pending: Vec<FaultRule>,
    log: Vec<WriteRecord>,
    /// `get` calls so far, per class of key.
    reads_by_class: HashMap<KeyClass, u64>,
    /// Armed read faults: the n-th `get` of a key of the class fails (`fail_read`).
    pending_reads: Vec<(KeyClass, u64)>,
    /// `list` calls of affinities so far.
    affinity_lists: u64,
}

impl State {
    fn bump(&mut self) -> i64 {
        self.revision += 1;
        self.revision
    }

    fn apply_create(&mut self, key: &Key, bytes: Vec<u8>) -> Result<Revision, DatastoreError> {
        let path = key_path(key);
        if self.objects.contains_key(&path) {
            return Err(DatastoreError::AlreadyExists(key.describe()));
        }
        Ok(self.store(path, bytes))
    }

    /// Writes `bytes` at `path` at a new revision, which it returns.
    fn store(&mut self, path: String, bytes: Vec<u8>) -> Revision {
        let mod_revision = self.bump();
        self.objects.insert(
            path,
            Entry {
                bytes,
                mod_revision,
            },
        );
        mod_revision.to_string()
    }

    /// The compare step of a CAS: `NotFound` when absent, `Conflict` when moved.
    fn compare(&self, key: &Key, path: &str, rev: Option<i64>) -> Result<(), DatastoreError> {
        match self.objects.get(path) {
            None => Err(DatastoreError::not_found(key)),
            Some(e) if rev.is_some_and(|r| r != e.mod_revision) => {
                Err(DatastoreError::Conflict(key.describe()))
            }
            Some(_) => Ok(()),
        }
    }

    fn apply_update(
        &mut self,
        key: &Key,
        bytes: Vec<u8>,
        rev: i64,
    ) -> Result<Revision, DatastoreError> {
        let path = key_path(key);
        self.compare(key, &path, Some(rev))?;
        Ok(self.store(path, bytes))
    }

    /// etcd's `If(version(create) == 0 && mod_revision(update) == rev) Put both`: both at
    /// one new revision, or neither with the first compare that failed.
    fn apply_pair(
        &mut self,
        (ckey, cbytes): (&Key, Vec<u8>),
        (ukey, ubytes, rev): (&Key, Vec<u8>, i64),
    ) -> Result<Revision, DatastoreError> {
        let (cpath, upath) = (key_path(ckey), key_path(ukey));
        if self.objects.contains_key(&cpath) {
            return Err(DatastoreError::AlreadyExists(ckey.describe()));
        }
        self.compare(ukey, &upath, Some(rev))?;
        let mod_revision = self.bump();
        for (path, bytes) in [(cpath, cbytes), (upath, ubytes)] {
            self.objects.insert(
                path,
                Entry {
                    bytes,
                    mod_revision,
                },
            );
        }
        Ok(mod_revision.to_string())
    }

    fn apply_delete(&mut self, key: &Key, rev: Option<i64>) -> Result<Revision, DatastoreError> {
        let path = key_path(key);
        self.compare(key, &path, rev)?;
        self.objects.remove(&path);
        Ok(self.bump().to_string())
    }

    /// Numbers a write and takes the faults that hit it.
    fn number_write(&mut self, key: &Key) -> (u64, Vec<Fault>) {
        self.writes += 1;
        let class = KeyClass::of(key);
        let in_class = self.writes_by_class.entry(class).or_insert(0);
        *in_class += 1;
        let (n, nc) = (self.writes, *in_class);
        let mut hit = Vec::new();
        self.pending.retain(|rule| {
            let count = match rule.class {
                None => n,
                Some(c) if c == class => nc,
                Some(_) => return true,
            };
            if rule.fault.nth() == count {
                hit.push(rule.fault);
                false
            } else {
                true
            }
        });
        (n, hit)
    }
}

/// The in-memory store. Cheap to create; share it by reference.
#[derive(Default)]
pub struct MemoryDatastore {
    state: Mutex<State>,
    /// Whether `create_and_update` is answered (etcd) or refused with `None` (Kubernetes).
    transactions: bool,
}

fn to_pair(key: Key, entry: &Entry) -> Result<KvPair, DatastoreError> {
    let mut value = decode_value(&key, &entry.bytes)?;
    let revision = entry.mod_revision.to_string();
    if matches!(key, Key::Resource { .. }) {
        set_resource_version(&mut value, &revision);
    }
    Ok(KvPair {
        key,
        value,
        revision,
    })
}

fn parse_rev(key: &Key, revision: &str) -> Result<i64, DatastoreError> {
    revision.parse().map_err(|_| {
        DatastoreError::Other(format!(
            "invalid revision {revision:?} for {}",
            key.describe()
        ))
    })
}

/// The key a stored path names (any kind), for `dump`.
fn key_of_path(path: &str) -> Option<Key> {
    let kinds = [
        Kind::WorkloadEndpoint,
        Kind::IpPool,
        Kind::ClusterInformation,
        Kind::Profile,
        Kind::Node,
        Kind::IpReservation,
        Kind::IpamConfiguration,
    ];
    if path == key_path(&Key::IpamConfig) {
        return Some(Key::IpamConfig);
    }
    let mut candidates: Vec<ListKind> = kinds
        .into_iter()
        .map(|kind| ListKind::Resources {
            kind,
            namespace: None,
            name_prefix: None,
        })
        .collect();
    candidates.push(ListKind::Blocks { version: None });
    candidates.push(ListKind::Handles);
    if let Some(c) = candidates
        .iter()
        .find(|c| path.starts_with(&list_prefix(c)))
    {
        return key_from_path(c, path);
    }
    // `/calico/ipam/v2/<type>/<host>/ipv<v>/block/<cidr>`
    let rest = path.strip_prefix("/calico/ipam/v2/")?;
    let (affinity_type, rest) = rest.split_once('/')?;
    let (host, _) = rest.split_once('/')?;
    key_from_path(
        &ListKind::Affinities {
            host: host.to_string(),
            affinity_type: affinity_type.to_string(),
            version: None,
        },
        path,
    )
}

impl MemoryDatastore {
    pub fn new() -> MemoryDatastore {
        MemoryDatastore::default()
    }

    /// A store that also answers `create_and_update`, as etcd does.
    pub fn transactional() -> MemoryDatastore {
        MemoryDatastore {
            transactions: true,
            ..MemoryDatastore::default()
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock leaves consistent state (every
        // mutation is a single step), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Arms a fault (see [`Fault`]); each fires at most once.
    pub fn inject(&self, rule: impl Into<FaultRule>) {
        self.lock().pending.push(rule.into());
    }

    /// Faults armed but not fired yet (a test asserts this is empty to know its faults hit).
    pub fn pending_faults(&self) -> Vec<FaultRule> {
        self.lock().pending.clone()
    }

    /// The `n`-th `get` (counting from 1 over the store's life) of a key of `class` is not
    /// answered: its caller gets `Unavailable`, as when a read meets a server error.
    pub fn fail_read(&self, class: KeyClass, n: u64) {
        self.lock().pending_reads.push((class, n));
    }

    /// `get` calls so far of keys of `class`.
    pub fn reads_of(&self, class: KeyClass) -> u64 {
        self.lock().reads_by_class.get(&class).copied().unwrap_or(0)
    }

    /// `list` calls of affinities so far (the cache's answers not counted).
    pub fn affinity_lists(&self) -> u64 {
        self.lock().affinity_lists
    }

    /// Read faults armed but not fired yet.
    pub fn pending_read_faults(&self) -> Vec<(KeyClass, u64)> {
        self.lock().pending_reads.clone()
    }

    /// Write calls so far (create, update, delete; failed ones included, `put_raw` not).
    pub fn writes(&self) -> u64 {
        self.lock().writes
    }

    /// Write calls so far to keys of `class`.
    pub fn writes_to(&self, class: KeyClass) -> u64 {
        self.lock()
            .writes_by_class
            .get(&class)
            .copied()
            .unwrap_or(0)
    }

    /// Every write call so far, in the order they completed (`n` is the order they were
    /// made: a write held back by `YieldBeforeWrite` completes after later ones).
    pub fn write_log(&self) -> Vec<WriteRecord> {
        self.lock().log.clone()
    }

    /// The current revision (that of the last applied write; 0 for a new store).
    pub fn revision(&self) -> Revision {
        self.lock().revision.to_string()
    }

    /// Stores `value` under `key` as it is (no resource preparation), creating or replacing,
    /// outside write counting and faults; for fixtures. Returns the new revision.
    pub fn put_raw(&self, key: &Key, value: &Value) -> Revision {
        self.put_raw_bytes(key, value.to_string().into_bytes())
    }

    /// `put_raw` with any bytes (an empty affinity, a value that does not decode).
    pub fn put_raw_bytes(&self, key: &Key, bytes: Vec<u8>) -> Revision {
        let mut st = self.lock();
        let mod_revision = st.bump();
        st.objects.insert(
            key_path(key),
            Entry {
                bytes,
                mod_revision,
            },
        );
        mod_revision.to_string()
    }

    /// The value under `key` as `get` would return it, `None` when absent or undecodable.
    pub fn peek(&self, key: &Key) -> Option<Value> {
        let st = self.lock();
        let entry = st.objects.get(&key_path(key))?;
        to_pair(key.clone(), entry).ok().map(|kv| kv.value)
    }

    /// Every stored object in key-path order, read as `get` would; a value that does not
    /// decode comes out as a JSON string of its bytes.
    pub fn dump(&self) -> Vec<KvPair> {
        let st = self.lock();
        st.objects
            .iter()
            .filter_map(|(path, entry)| {
                let key = key_of_path(path)?;
                Some(to_pair(key.clone(), entry).unwrap_or_else(|_| KvPair {
                    key,
                    value: Value::String(String::from_utf8_lossy(&entry.bytes).into_owned()),
                    revision: entry.mod_revision.to_string(),
                }))
            })
            .collect()
    }

    /// Runs one write: numbering, faults, then `apply` under the lock.
    async fn write<F>(
        &self,
        op: WriteOp,
        key: &Key,
        value: Option<&Value>,
        created: Option<&Key>,
        apply: F,
    ) -> Result<Revision, DatastoreError>
    where
        F: FnOnce(&mut State) -> Result<Revision, DatastoreError>,
    {
        let (n, faults) = self.lock().number_write(key);
        for f in &faults {
            if matches!(f, Fault::YieldBeforeWrite(_)) {
                tokio::task::yield_now().await;
            }
        }
        let failing = faults
            .iter()
            .find(|f| !matches!(f, Fault::YieldBeforeWrite(_)));
        let injected = |what: &str| {
            DatastoreError::Unavailable(format!(
                "injected fault: {what} of write {n} ({op:?} {})",
                key.describe()
            ))
        };
        let mut st = self.lock();
        let (applied, result) = match failing {
            Some(Fault::ConflictOnWrite(_)) => {
                let e = if op == WriteOp::Create {
                    DatastoreError::AlreadyExists(key.describe())
                } else {
                    DatastoreError::Conflict(key.describe())
                };
                (false, Err(e))
            }
            Some(Fault::UnavailableOnWrite(_)) => (false, Err(injected("unavailable"))),
            Some(Fault::LoseAnswerOfWrite(_)) => {
                let applied = apply(&mut st).is_ok();
                (applied, Err(injected("lost answer")))
            }
            Some(Fault::YieldBeforeWrite(_)) | None => {
                let r = apply(&mut st);
                (r.is_ok(), r)
            }
        };
        st.log.push(WriteRecord {
            n,
            op,
            key: key.clone(),
            value: value.cloned(),
            applied,
            error: result.as_ref().err().cloned(),
            created: created.cloned(),
        });
        result
    }
}

impl Datastore for MemoryDatastore {
    /// As the Kubernetes datastore: the allocator's tests exercise the copies.
    fn keeps_block_copies(&self) -> bool {
        true
    }

    async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        let mut st = self.lock();
        let class = KeyClass::of(key);
        let in_class = st.reads_by_class.entry(class).or_insert(0);
        *in_class += 1;
        let n = *in_class;
        let armed = st.pending_reads.len();
        st.pending_reads
            .retain(|(c, nth)| !(*c == class && *nth == n));
        if st.pending_reads.len() != armed {
            return Err(DatastoreError::Unavailable(format!(
                "injected fault: read {n} of {} not answered",
                key.describe()
            )));
        }
        match st.objects.get(&key_path(key)) {
            Some(entry) => to_pair(key.clone(), entry),
            None => Err(DatastoreError::not_found(key)),
        }
    }

    async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        let prefix = list_prefix(what);
        let mut st = self.lock();
        if matches!(what, ListKind::Affinities { .. }) {
            st.affinity_lists += 1;
        }
        let mut out = Vec::new();
        for (path, entry) in st.objects.range(prefix.clone()..) {
            if !path.starts_with(&prefix) {
                break;
            }
            if let Some(key) = key_from_path(what, path) {
                out.push(to_pair(key, entry)?);
            }
        }
        Ok(out)
    }

    async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
        let bytes = encode_value(key, value)?;
        self.write(WriteOp::Create, key, Some(value), None, |st| {
            st.apply_create(key, bytes)
        })
        .await
    }

    async fn update(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        let rev = parse_rev(key, revision)?;
        let bytes = encode_value(key, value)?;
        self.write(WriteOp::Update, key, Some(value), None, |st| {
            st.apply_update(key, bytes, rev)
        })
        .await
    }

    async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError> {
        let rev = match revision.filter(|r| !r.is_empty()) {
            Some(r) => Some(parse_rev(key, r)?),
            None => None,
        };
        self.write(WriteOp::Delete, key, None, None, |st| {
            st.apply_delete(key, rev)
        })
        .await
        .map(|_| ())
    }

    async fn create_and_update(
        &self,
        (ckey, cvalue): (&Key, &Value),
        (ukey, uvalue, revision): (&Key, &Value, &str),
    ) -> Option<Result<Revision, DatastoreError>> {
        if !self.transactions {
            return None;
        }
        let prepared = parse_rev(ukey, revision).and_then(|rev| {
            Ok((
                rev,
                encode_value(ckey, cvalue)?,
                encode_value(ukey, uvalue)?,
            ))
        });
        let (rev, cbytes, ubytes) = match prepared {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        };
        let op = WriteOp::CreateAndUpdate;
        Some(
            self.write(op, ukey, Some(uvalue), Some(ckey), |st| {
                st.apply_pair((ckey, cbytes), (ukey, ubytes, rev))
            })
            .await,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::support::net::IpNet;
    use serde_json::json;

    fn cidr(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    fn handle(id: &str) -> Key {
        Key::Handle { id: id.into() }
    }

    fn block(c: &str) -> Key {
        Key::Block { cidr: cidr(c) }
    }

    #[tokio::test]
    async fn create_get_update_delete() {
        let ds = MemoryDatastore::new();
        let k = handle("h1");
        let e = ds.get(&k).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "resource does not exist: IPAMHandleKey(id=h1) with error: <nil>"
        );
        let r1 = ds.create(&k, &json!({"block":{}})).await.unwrap();
        assert_eq!(r1, "1");
        assert!(matches!(
            ds.create(&k, &json!({})).await.unwrap_err(),
            DatastoreError::AlreadyExists(key) if key == k.describe()
        ));
        let kv = ds.get(&k).await.unwrap();
        assert_eq!((kv.value, kv.revision.as_str()), (json!({"block":{}}), "1"));
        let r2 = ds.update(&k, &json!({"a":1}), &r1).await.unwrap();
        assert_eq!(r2, "2");
        assert!(matches!(
            ds.update(&k, &json!({}), &r1).await.unwrap_err(),
            DatastoreError::Conflict(key) if key == k.describe()
        ));
        assert!(ds.delete(&k, Some(&r1)).await.unwrap_err().is_conflict());
        assert!(ds
            .update(&handle("x"), &json!({}), "1")
            .await
            .unwrap_err()
            .is_not_found());
        assert!(ds
            .update(&k, &json!({}), "abc")
            .await
            .unwrap_err()
            .to_string()
            .contains("invalid revision"));
        assert!(ds
            .delete(&handle("x"), None)
            .await
            .unwrap_err()
            .is_not_found());
        ds.delete(&k, Some(&r2)).await.unwrap();
        // Deletes move the revision too; failed writes do not.
        assert_eq!(ds.revision(), "3");
        assert!(ds.get(&k).await.unwrap_err().is_not_found());
        // Unconditional delete, and an empty revision means none.
        ds.create(&k, &json!({})).await.unwrap();
        ds.delete(&k, Some("")).await.unwrap();
        assert!(ds.dump().is_empty());
        // Every call counts, failed ones too, except the one whose revision did not parse
        // (nothing would have been sent to etcd).
        assert_eq!(ds.writes(), 10);
        assert_eq!(ds.writes_to(KeyClass::Handle), 10);
    }

    #[tokio::test]
    async fn resources_get_their_version_on_read_only() {
        let ds = MemoryDatastore::new();
        let k = Key::resource(Kind::IpPool, None, "p1");
        let v =
            json!({"metadata":{"name":"p1","resourceVersion":"99"},"spec":{"cidr":"10.0.0.0/24"}});
        let rev = ds.create(&k, &v).await.unwrap();
        let kv = ds.get(&k).await.unwrap();
        assert_eq!(
            kv.value,
            json!({"metadata":{"name":"p1","resourceVersion":rev},"spec":{"cidr":"10.0.0.0/24"},
                   "kind":"IPPool","apiVersion":"projectcalico.org/v3"})
        );
        // Stored without it (what etcd would hold).
        let st = ds.lock();
        let stored: Value = serde_json::from_slice(&st.objects[&key_path(&k)].bytes).unwrap();
        assert!(stored["metadata"].get("resourceVersion").is_none());
    }

    #[tokio::test]
    async fn lists_filter_and_order_as_etcd() {
        let ds = MemoryDatastore::new();
        let keys = [
            block("10.0.1.0/26"),
            block("10.0.0.64/26"),
            block("fd00::/122"),
            Key::host_affinity("node1", cidr("10.0.1.0/26")),
            Key::host_affinity("node1", cidr("fd00::/122")),
            Key::host_affinity("node10", cidr("10.0.0.64/26")),
            Key::BlockAffinity {
                host: "node1".into(),
                cidr: cidr("10.0.2.0/26"),
                affinity_type: "virtual".into(),
            },
            handle("b"),
            handle("a"),
            Key::IpamConfig,
            Key::resource(Kind::WorkloadEndpoint, Some("ns1"), "node1-k8s-p-eth0"),
            Key::resource(Kind::WorkloadEndpoint, Some("ns1"), "node2-k8s-q-eth0"),
            Key::resource(Kind::WorkloadEndpoint, Some("ns2"), "node1-k8s-r-eth0"),
            Key::resource(Kind::IpPool, None, "pool-b"),
            Key::resource(Kind::IpPool, None, "pool-a"),
        ];
        for k in &keys {
            ds.create(k, &json!({})).await.unwrap();
        }
        let list = |what: ListKind| {
            let ds = &ds;
            async move {
                ds.list(&what)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|kv| kv.key)
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(
            list(ListKind::Blocks { version: None }).await,
            [
                block("10.0.0.64/26"),
                block("10.0.1.0/26"),
                block("fd00::/122")
            ]
        );
        assert_eq!(
            list(ListKind::Blocks { version: Some(6) }).await,
            [block("fd00::/122")]
        );
        // "node1" does not list "node10"; the type and the version filter.
        assert_eq!(
            list(ListKind::Affinities {
                host: "node1".into(),
                affinity_type: "host".into(),
                version: None
            })
            .await,
            [
                Key::host_affinity("node1", cidr("10.0.1.0/26")),
                Key::host_affinity("node1", cidr("fd00::/122"))
            ]
        );
        assert_eq!(
            list(ListKind::Affinities {
                host: "node1".into(),
                affinity_type: "host".into(),
                version: Some(4)
            })
            .await,
            [Key::host_affinity("node1", cidr("10.0.1.0/26"))]
        );
        assert_eq!(list(ListKind::Handles).await, [handle("a"), handle("b")]);
        assert_eq!(
            list(ListKind::Resources {
                kind: Kind::WorkloadEndpoint,
                namespace: Some("ns1".into()),
                name_prefix: Some("node1-k8s-".into()),
            })
            .await,
            [Key::resource(
                Kind::WorkloadEndpoint,
                Some("ns1"),
                "node1-k8s-p-eth0"
            )]
        );
        assert_eq!(
            list(ListKind::Resources {
                kind: Kind::WorkloadEndpoint,
                namespace: None,
                name_prefix: None,
            })
            .await
            .len(),
            3
        );
        assert_eq!(
            list(ListKind::Resources {
                kind: Kind::IpPool,
                namespace: None,
                name_prefix: None,
            })
            .await,
            [
                Key::resource(Kind::IpPool, None, "pool-a"),
                Key::resource(Kind::IpPool, None, "pool-b")
            ]
        );
        // dump: everything, in etcd key order, each key recovered.
        let dumped: Vec<Key> = ds.dump().into_iter().map(|kv| kv.key).collect();
        let mut expected = keys.to_vec();
        expected.sort_by_key(key_path);
        assert_eq!(dumped, expected);
    }

    #[tokio::test]
    async fn faults_fire_once_at_their_write() {
        let ds = MemoryDatastore::new();
        ds.inject(Fault::ConflictOnWrite(2));
        ds.inject(Fault::UnavailableOnWrite(3));
        ds.inject(Fault::LoseAnswerOfWrite(4));
        let k = handle("h");
        let r1 = ds.create(&k, &json!({"n":1})).await.unwrap();
        // 2: a lost race, not applied.
        assert!(ds
            .update(&k, &json!({"n":2}), &r1)
            .await
            .unwrap_err()
            .is_conflict());
        // 3: unavailable, not applied.
        let e = ds.update(&k, &json!({"n":3}), &r1).await.unwrap_err();
        assert!(matches!(e, DatastoreError::Unavailable(_)), "{e}");
        assert_eq!(ds.peek(&k), Some(json!({"n":1})));
        // 4: applied, answer lost.
        let e = ds.update(&k, &json!({"n":4}), &r1).await.unwrap_err();
        assert!(matches!(e, DatastoreError::Unavailable(_)), "{e}");
        assert_eq!(ds.peek(&k), Some(json!({"n":4})));
        assert!(ds.pending_faults().is_empty());
        // A conflict on a create is the create's lost race: AlreadyExists.
        ds.inject(Fault::ConflictOnWrite(5));
        assert!(ds
            .create(&handle("other"), &json!({}))
            .await
            .unwrap_err()
            .is_already_exists());
        assert!(ds.peek(&handle("other")).is_none());
        let log = ds.write_log();
        assert_eq!(
            log.iter().map(|r| (r.n, r.applied)).collect::<Vec<_>>(),
            [(1, true), (2, false), (3, false), (4, true), (5, false)]
        );
        assert!(log[3].error.is_some());
    }

    #[tokio::test]
    async fn faults_by_key_class() {
        let ds = MemoryDatastore::new();
        ds.inject(Fault::on(KeyClass::Block, Fault::ConflictOnWrite(2)));
        ds.create(&block("10.0.0.0/26"), &json!({})).await.unwrap();
        for i in 0..3 {
            ds.create(&handle(&format!("h{i}")), &json!({}))
                .await
                .unwrap();
        }
        assert_eq!(ds.pending_faults().len(), 1);
        let e = ds.delete(&block("10.0.0.0/26"), None).await.unwrap_err();
        assert!(e.is_conflict());
        assert!(ds.pending_faults().is_empty());
        assert_eq!(ds.writes_to(KeyClass::Block), 2);
        assert_eq!(ds.writes(), 5);
        // put_raw is not a counted write, but moves the revision.
        let before = ds.revision();
        ds.put_raw(&block("10.0.0.0/26"), &json!({"x":1}));
        assert_ne!(ds.revision(), before);
        assert_eq!(ds.writes(), 5);
    }

    #[tokio::test]
    async fn yield_interleaves_joined_callers() {
        let ds = MemoryDatastore::new();
        let k = handle("h");
        let r0 = ds.create(&k, &json!({"by":"none"})).await.unwrap();
        // Write 2 (a's) yields: b's write (3) lands first, so a's CAS conflicts.
        ds.inject(Fault::YieldBeforeWrite(2));
        let (va, vb) = (json!({"by":"a"}), json!({"by":"b"}));
        let (ra, rb) = tokio::join!(ds.update(&k, &va, &r0), ds.update(&k, &vb, &r0));
        assert!(ra.unwrap_err().is_conflict());
        rb.unwrap();
        assert_eq!(ds.peek(&k), Some(json!({"by":"b"})));
    }

    #[tokio::test]
    async fn raw_fixtures_and_empty_affinities() {
        let ds = MemoryDatastore::new();
        let aff = Key::host_affinity("node1", cidr("10.0.0.0/26"));
        ds.put_raw_bytes(&aff, Vec::new());
        // An empty affinity value reads as an empty object, as on etcd.
        assert_eq!(ds.get(&aff).await.unwrap().value, json!({}));
        let b = block("10.0.0.0/26");
        ds.put_raw_bytes(&b, b"not json".to_vec());
        assert!(matches!(
            ds.get(&b).await.unwrap_err(),
            DatastoreError::Decode { .. }
        ));
        assert_eq!(ds.dump()[0].value, json!("not json"));
    }
}
