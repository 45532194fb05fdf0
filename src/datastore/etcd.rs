//! etcd v3 backend: libcalico-go's key paths (`backend/model`) and its
//! transactions: create = `If(version == 0) Put`, update = `If(mod_revision == rev) Put`,
//! delete = `[If(mod_revision == rev)] Delete`, each with `Else Get` to tell a conflict from a
//! missing key. Revisions are decimal ModRevisions. Every request is bounded by a timeout and
//! by the call's deadline (`crate::support::deadline`), so a dead or frozen etcd fails a call instead
//! of hanging it: an attempt gets `min(its timeout, what is left)`, and once the deadline has
//! passed a request is not even sent, which also ends the IPAM's compare-and-swap loops.
//!
//! Reads made together (the branches of one `join!`, such as ADD's first round trip: the
//! ready gate, the endpoint and profile lookups and AutoAssign's reads) go to etcd as one
//! read-only transaction: one request instead of one each, all read at one revision, with
//! the same answers (see `ReadQueue`).

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::channel::oneshot;

use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, GetOptions, GetResponse, Identity,
    KeyValue, KvClient, TlsOptions, Txn, TxnOp, TxnOpResponse,
};
use serde_json::Value;
use tracing::debug;

use super::kubernetes::client::KubeClient;
use super::resources::{prepare_resource_for_storage, set_resource_version};
use super::{ClientError, Datastore, DatastoreError, Key, KvPair, ListKind, Revision};
use crate::support::deadline;
use crate::support::net::IpNet;

const RESOURCES: &str = "/calico/resources/v3/projectcalico.org/";
const IPAM: &str = "/calico/ipam/v2/";

/// How to reach etcd.
#[derive(Clone, Debug, Default)]
pub struct EtcdConfig {
    /// URLs such as `http://127.0.0.1:2379` (the `etcd_endpoints` comma list, split).
    pub endpoints: Vec<String>,
    pub key_file: Option<String>,
    pub cert_file: Option<String>,
    pub ca_cert_file: Option<String>,
    pub username: Option<String>,
    pub password: Option<String>,
    /// Connect and per-request timeout.
    pub timeout: Duration,
}

pub struct EtcdDatastore {
    kv: KvClient,
    timeout: Duration,
    reads: ReadQueue,
    /// With policy type k8s: the API client for the pod's reads, made at connect time.
    policy_client: Option<Arc<KubeClient>>,
    /// Answers to reads made ahead (`Datastore::prefetch`), by key path (`None`: not
    /// found), each taken by the first `get` of its key; a write of the key drops it.
    prefetched: Mutex<HashMap<String, Option<KvPair>>>,
}

/// At most this many reads go in one transaction (etcd refuses more than `--max-txn-ops`,
/// 128 by default, and one answer carries all of them).
const MAX_READS_PER_TXN: usize = 16;

/// One read (a key, or a prefix), waiting to be sent.
struct QueuedRead {
    /// `get <key>` or `list <prefix>`, for the debug log.
    what: String,
    path: String,
    prefix: bool,
    answer: oneshot::Sender<Result<GetResponse, DatastoreError>>,
}

/// Reads waiting to be sent together. A read joins the queue and yields once, so the other
/// reads of the same poll of the call's task (the branches of a `join!`) join it too; the
/// first of them to run again takes the whole queue and sends it: alone as a range request,
/// or several as one transaction of ranges without compares (etcd serves a read-only
/// transaction as it serves a range: linearizable, at one revision). Every read gets its own
/// answer, or the request's error. A read whose sender was dropped before answering (its
/// future cancelled) is sent again on its own.
#[derive(Default)]
struct ReadQueue {
    pending: Mutex<Vec<QueuedRead>>,
}

impl ReadQueue {
    fn push(&self, read: QueuedRead) {
        self.pending
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(read);
    }

    fn take(&self) -> Vec<QueuedRead> {
        std::mem::take(&mut *self.pending.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

/// Attempts per request when the transport fails.
const TRANSPORT_ATTEMPTS: u64 = 4;

/// A failure to reach a member (as opposed to an answer from etcd).
fn is_transport_error(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => matches!(
            s.code(),
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
        ),
        _ => false,
    }
}

/// A member that refused the connection: the request never reached etcd, and the balancer
/// sends the next attempt to another member (the refusing one is reconnecting, not ready).
fn is_refused_connection(e: &etcd_client::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = match e {
        etcd_client::Error::GRpcStatus(s) => Some(s),
        etcd_client::Error::TransportError(t) => Some(t),
        etcd_client::Error::IoError(io) => Some(io),
        _ => None,
    };
    while let Some(c) = cause {
        if c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

fn unavailable(e: impl std::fmt::Display) -> DatastoreError {
    DatastoreError::Unavailable(e.to_string())
}

/// Why one attempt of a request got no answer (another attempt may follow).
#[derive(Debug, thiserror::Error)]
enum AttemptFailed {
    #[error(transparent)]
    Transport(etcd_client::Error),
    #[error("etcd request timed out after {0:?}")]
    TimedOut(Duration),
}

impl From<AttemptFailed> for DatastoreError {
    fn from(e: AttemptFailed) -> DatastoreError {
        match e {
            AttemptFailed::Transport(e) => DatastoreError::Client(ClientError::new(e)),
            e @ AttemptFailed::TimedOut(_) => unavailable(e),
        }
    }
}

impl EtcdDatastore {
    pub async fn connect(cfg: &EtcdConfig) -> Result<EtcdDatastore, DatastoreError> {
        if cfg.endpoints.is_empty() {
            return Err(DatastoreError::Config("no etcd endpoints specified".into()));
        }
        let timeout = if cfg.timeout.is_zero() {
            Duration::from_secs(5)
        } else {
            cfg.timeout
        };
        let mut opts = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        if let (Some(u), Some(p)) = (&cfg.username, &cfg.password) {
            opts = opts.with_user(u.clone(), p.clone());
        }
        let wants_tls = cfg.ca_cert_file.is_some()
            || cfg.cert_file.is_some()
            || cfg.endpoints.iter().any(|e| e.starts_with("https://"));
        if wants_tls {
            // As etcd's `TLSInfo.ClientConfig`, in libcalico-go's words: the key pair first
            // (both or neither), then the CA.
            let failed = |e: String| {
                DatastoreError::Config(format!("could not initialize etcdv3 client: {e}"))
            };
            let read = |p: &str| {
                // A regular file only: a FIFO here would block the call (`input_file`).
                crate::support::input_file::read(std::path::Path::new(p))
                    .map_err(|e| failed(crate::support::gocompat::path_error("open", p, &e)))
            };
            let mut tls = TlsOptions::new();
            match (&cfg.cert_file, &cfg.key_file) {
                (Some(cert), Some(key)) => {
                    let cert = read(cert)?;
                    tls = tls.identity(Identity::from_pem(cert, read(key)?));
                }
                (None, None) => {}
                (cert, key) => {
                    return Err(failed(format!(
                        "KeyFile and CertFile must both be present[key: {}, cert: {}]",
                        key.as_deref().unwrap_or_default(),
                        cert.as_deref().unwrap_or_default()
                    )))
                }
            }
            if let Some(ca) = &cfg.ca_cert_file {
                tls = tls.ca_certificate(Certificate::from_pem(read(ca)?));
            }
            opts = opts.with_tls(tls);
        }
        let what = || format!("connecting to etcd at {:?}", cfg.endpoints);
        deadline::check(what())?;
        let (until, capped) = deadline::cap_at(timeout);
        let client = tokio::time::timeout_at(until, Client::connect(&cfg.endpoints, Some(opts)))
            .await
            .map_err(|_| match capped {
                true => DatastoreError::Deadline(deadline::expired(what())),
                false => unavailable(format!("timed out connecting to {:?}", cfg.endpoints)),
            })?
            .map_err(|e| DatastoreError::Connect {
                endpoints: cfg.endpoints.clone(),
                source: ClientError::new(e),
            })?;
        Ok(EtcdDatastore {
            kv: client.kv_client(),
            timeout,
            reads: ReadQueue::default(),
            policy_client: None,
            prefetched: Mutex::default(),
        })
    }

    /// This datastore, holding the API client for policy type k8s (`backend::connect`).
    pub fn with_policy_client(mut self, client: Option<Arc<KubeClient>>) -> EtcdDatastore {
        self.policy_client = client;
        self
    }

    /// The API client for policy type k8s, when one was made at connect time.
    pub fn policy_client(&self) -> Option<&Arc<KubeClient>> {
        self.policy_client.as_ref()
    }

    /// A range read of `path` (a prefix when `prefix`), sent together with the reads made in
    /// the same poll (see `ReadQueue`).
    async fn range(
        &self,
        what: String,
        path: String,
        prefix: bool,
    ) -> Result<GetResponse, DatastoreError> {
        // Past the deadline, fail at once, naming this read (not after the yield below,
        // where a timeout around the caller could fire first and name something vaguer).
        deadline::check(format!("waiting for etcd ({what})"))?;
        let (answer, answered) = oneshot::channel();
        self.reads.push(QueuedRead {
            what: what.clone(),
            path: path.clone(),
            prefix,
            answer,
        });
        tokio::task::yield_now().await;
        let batch = self.reads.take();
        if !batch.is_empty() {
            self.send_reads(batch).await;
        }
        match answered.await {
            Ok(answer) => answer,
            Err(oneshot::Canceled) => self.range_alone(&what, &path, prefix).await,
        }
    }

    /// One range request.
    async fn range_alone(
        &self,
        what: &str,
        path: &str,
        prefix: bool,
    ) -> Result<GetResponse, DatastoreError> {
        self.bounded(what, || {
            let mut kv = self.kv.clone();
            let path = path.to_string();
            async move {
                kv.get(path, prefix.then(|| GetOptions::new().with_prefix()))
                    .await
            }
        })
        .await
    }

    /// Sends queued reads (one range request, or transactions of at most
    /// `MAX_READS_PER_TXN`, at once) and answers each.
    async fn send_reads(&self, mut batch: Vec<QueuedRead>) {
        if batch.len() > MAX_READS_PER_TXN {
            let mut chunks = Vec::new();
            while batch.len() > MAX_READS_PER_TXN {
                let rest = batch.split_off(MAX_READS_PER_TXN);
                chunks.push(std::mem::replace(&mut batch, rest));
            }
            chunks.push(batch);
            futures::future::join_all(chunks.into_iter().map(|c| Box::pin(self.send_reads(c))))
                .await;
            return;
        }
        if batch.len() == 1 {
            if let Some(read) = batch.pop() {
                let answer = self.range_alone(&read.what, &read.path, read.prefix).await;
                let _ = read.answer.send(answer);
            }
            return;
        }
        let ops: Vec<TxnOp> = batch
            .iter()
            .map(|r| {
                let opts = r.prefix.then(|| GetOptions::new().with_prefix());
                TxnOp::get(r.path.clone(), opts)
            })
            .collect();
        let txn = Txn::new().and_then(ops);
        let whats: Vec<&str> = batch.iter().map(|r| r.what.as_str()).collect();
        let what = format!("reads [{}]", whats.join(", "));
        let sent = self
            .bounded(&what, || {
                let mut kv = self.kv.clone();
                let txn = txn.clone();
                async move { kv.txn(txn).await }
            })
            .await;
        let mut answers = match sent {
            Ok(resp) => resp
                .op_responses()
                .into_iter()
                .map(|r| match r {
                    TxnOpResponse::Get(g) => Ok(g),
                    other => Err(unavailable(format!("unexpected answer {other:?}"))),
                })
                .collect(),
            Err(e) => vec![Err(e); batch.len()],
        };
        answers.resize_with(batch.len(), || {
            Err(unavailable("etcd answered fewer reads than were sent"))
        });
        for (read, answer) in batch.into_iter().zip(answers) {
            let _ = read.answer.send(answer);
        }
    }

    /// Runs one request (`what`: `get <key>`, `txn <key>`, …) with the per-request timeout.
    /// Transport failures (a member down, a leader election) are retried a few times so a
    /// cluster keeps serving through its survivors; every write is a compare-and-swap, so a
    /// retried one cannot apply twice unnoticed. Nothing is sent, and nothing retried, past
    /// the call's deadline.
    async fn bounded<T, F, Fut>(&self, what: &str, op: F) -> Result<T, DatastoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.bounded_counted(what, op).await.map(|(v, _)| v)
    }

    /// `bounded`, also saying how many attempts it took.
    async fn bounded_counted<T, F, Fut>(
        &self,
        what: &str,
        mut op: F,
    ) -> Result<(T, u64), DatastoreError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        // A request stuck on a member that just died is abandoned after half the budget and
        // sent again (the balancer then picks a live member).
        let per_attempt = self.timeout / 2;
        let waiting = || format!("waiting for etcd ({what})");
        let mut attempt = 0u64;
        loop {
            attempt += 1;
            deadline::check(waiting())?;
            let (until, capped) = deadline::cap_at(per_attempt);
            // One debug line per request (the round trips of a call, in order, with their
            // times: BENCHMARKS.md counts them from these).
            let sent = std::time::Instant::now();
            let mut refused = false;
            let err = match tokio::time::timeout_at(until, op()).await {
                Ok(Ok(v)) => {
                    debug!(what, attempt, took = ?sent.elapsed(), "etcd request");
                    return Ok((v, attempt));
                }
                Ok(Err(e)) if is_transport_error(&e) => {
                    refused = is_refused_connection(&e);
                    AttemptFailed::Transport(e)
                }
                Ok(Err(e)) => return Err(DatastoreError::Client(ClientError::new(e))),
                Err(_) if capped => return Err(deadline::expired(waiting()).into()),
                Err(_) => AttemptFailed::TimedOut(per_attempt),
            };
            if attempt >= TRANSPORT_ATTEMPTS {
                return Err(err.into());
            }
            // A refused connection is retried at once: nothing was sent, and the next attempt
            // goes to another member. Anything else waits, longer each time.
            let backoff = match refused {
                true => Duration::ZERO,
                false => Duration::from_millis(100 * attempt),
            };
            debug!(attempt, ?backoff, error = %err, "etcd transport error; retrying");
            tokio::time::sleep(deadline::cap(backoff).0).await;
            deadline::check(format!("retrying etcd ({what}) after: {err}"))?;
        }
    }

    /// A transaction, and how many attempts it took (more than one: an earlier attempt may
    /// have been applied).
    async fn txn_counted(
        &self,
        path: &str,
        txn: Txn,
    ) -> Result<(etcd_client::TxnResponse, u64), DatastoreError> {
        self.bounded_counted(&format!("txn {path}"), || {
            let mut kv = self.kv.clone();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await
    }
}

/// `10.0.0.0/26` → `10.0.0.0-26` (only the first `/`).
fn dashed(cidr: &IpNet) -> String {
    cidr.masked().to_string().replacen('/', "-", 1)
}

fn undashed(s: &str) -> Option<IpNet> {
    let (ip, len) = s.rsplit_once('-')?;
    format!("{ip}/{len}").parse().ok()
}

/// The etcd key of an object.
pub fn key_path(key: &Key) -> String {
    match key {
        Key::Resource {
            kind,
            namespace,
            name,
        } => match namespace {
            Some(ns) if kind.namespaced() => format!("{RESOURCES}{}/{ns}/{name}", kind.plural()),
            _ => format!("{RESOURCES}{}/{name}", kind.plural()),
        },
        Key::Block { cidr } => format!(
            "{IPAM}assignment/ipv{}/block/{}",
            cidr.version(),
            dashed(cidr)
        ),
        Key::BlockAffinity {
            host,
            cidr,
            affinity_type,
        } => format!(
            "{IPAM}{affinity_type}/{host}/ipv{}/block/{}",
            cidr.version(),
            dashed(cidr)
        ),
        Key::Handle { id } => format!("{IPAM}handle/{id}"),
        Key::IpamConfig => format!("{IPAM}config"),
    }
}

/// The prefix a list reads.
pub fn list_prefix(what: &ListKind) -> String {
    match what {
        ListKind::Resources {
            kind,
            namespace,
            name_prefix,
        } => {
            let mut p = format!("{RESOURCES}{}/", kind.plural());
            if let Some(ns) = namespace.as_ref().filter(|_| kind.namespaced()) {
                p.push_str(ns);
                p.push('/');
            }
            if let Some(np) = name_prefix {
                p.push_str(np);
            }
            p
        }
        ListKind::Blocks { version } => match version {
            Some(v) => format!("{IPAM}assignment/ipv{v}/block/"),
            None => format!("{IPAM}assignment/"),
        },
        ListKind::Affinities {
            host,
            affinity_type,
            version,
        } => match version {
            Some(v) => format!("{IPAM}{affinity_type}/{host}/ipv{v}/block/"),
            None => format!("{IPAM}{affinity_type}/{host}/"),
        },
        ListKind::Handles => format!("{IPAM}handle/"),
    }
}

/// Recovers the typed key of a listed path.
pub(crate) fn key_from_path(what: &ListKind, path: &str) -> Option<Key> {
    match what {
        ListKind::Resources { kind, .. } => {
            let rest = path.strip_prefix(&format!("{RESOURCES}{}/", kind.plural()))?;
            let (namespace, name) = if kind.namespaced() {
                let (ns, name) = rest.split_once('/')?;
                (Some(ns.to_string()), name)
            } else {
                (None, rest)
            };
            Some(Key::Resource {
                kind: *kind,
                namespace,
                name: name.to_string(),
            })
        }
        ListKind::Blocks { .. } => {
            let last = path.rsplit('/').next()?;
            path.contains("/block/").then_some(())?;
            Some(Key::Block {
                cidr: undashed(last)?,
            })
        }
        ListKind::Affinities {
            host,
            affinity_type,
            ..
        } => {
            path.contains("/block/").then_some(())?;
            let last = path.rsplit('/').next()?;
            Some(Key::BlockAffinity {
                host: host.clone(),
                cidr: undashed(last)?,
                affinity_type: affinity_type.clone(),
            })
        }
        ListKind::Handles => Some(Key::Handle {
            id: path.strip_prefix(&format!("{IPAM}handle/"))?.to_string(),
        }),
    }
}

pub(crate) fn decode_value(key: &Key, raw: &[u8]) -> Result<Value, DatastoreError> {
    if raw.is_empty() && matches!(key, Key::BlockAffinity { .. }) {
        return Ok(Value::Object(Default::default()));
    }
    serde_json::from_slice(raw).map_err(|e| DatastoreError::decode(key_path(key), e))
}

fn to_pair(key: Key, kv: &KeyValue) -> Result<KvPair, DatastoreError> {
    let mut value = decode_value(&key, kv.value())?;
    let revision = kv.mod_revision().to_string();
    if matches!(key, Key::Resource { .. }) {
        set_resource_version(&mut value, &revision);
    }
    Ok(KvPair {
        key,
        value,
        revision,
    })
}

pub(crate) fn encode_value(key: &Key, value: &Value) -> Result<Vec<u8>, DatastoreError> {
    let bytes = match key {
        Key::Resource { kind, .. } => {
            let v = prepare_resource_for_storage(*kind, value);
            serde_json::to_vec(&v)
        }
        _ => serde_json::to_vec(value),
    };
    bytes.map_err(DatastoreError::encode)
}

fn parse_rev(key: &Key, revision: &str) -> Result<i64, DatastoreError> {
    revision.parse().map_err(|_| {
        DatastoreError::Other(format!(
            "invalid revision {revision:?} for {}",
            key.describe()
        ))
    })
}

/// After a failed conditional txn, the `Else Get` tells conflict from absence.
fn failed_compare(key: &Key, resp: &etcd_client::TxnResponse) -> DatastoreError {
    let exists = resp.op_responses().iter().any(|r| match r {
        TxnOpResponse::Get(g) => !g.kvs().is_empty(),
        _ => false,
    });
    if exists {
        DatastoreError::Conflict(key.describe())
    } else {
        DatastoreError::not_found(key)
    }
}

/// When a conditional write "fails" but the key already holds exactly the bytes we wrote,
/// an earlier attempt of this same request was applied and its answer lost (a member died
/// mid-request): that is success, at the stored revision. Without this, a retried create or
/// update would be taken for a conflict and applied twice by the caller's retry loop.
fn already_applied(resp: &etcd_client::TxnResponse, bytes: &[u8]) -> Option<Revision> {
    resp.op_responses().iter().find_map(|r| match r {
        TxnOpResponse::Get(g) => g
            .kvs()
            .first()
            .filter(|kv| kv.value() == bytes)
            .map(|kv| kv.mod_revision().to_string()),
        _ => None,
    })
}

fn header_revision(resp: &etcd_client::TxnResponse) -> Revision {
    resp.header()
        .map(|h| h.revision().to_string())
        .unwrap_or_default()
}

impl EtcdDatastore {
    /// `Datastore::prefetch`: `keys` read now, in the transaction of the reads made in the
    /// same poll (`ReadQueue`: the call's other first reads). A read that fails is not kept:
    /// the later `get` makes its own.
    pub async fn prefetch_keys(&self, keys: &[Key]) {
        let reads = keys.iter().map(|key| async move {
            let path = key_path(key);
            let resp = self.range(format!("get {path}"), path.clone(), false).await;
            let answer = match resp {
                Ok(r) => match r.kvs().first().map(|item| to_pair(key.clone(), item)) {
                    Some(Ok(kv)) => Some(Some(kv)),
                    Some(Err(_)) => None,
                    None => Some(None),
                },
                Err(_) => None,
            };
            (path, answer)
        });
        let answers = futures::future::join_all(reads).await;
        let mut kept = self
            .prefetched
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (path, answer) in answers {
            if let Some(a) = answer {
                kept.insert(path, a);
            }
        }
    }

    /// The answer of a read of `path` made ahead, if there is one (once).
    fn take_prefetched(&self, path: &str) -> Option<Option<KvPair>> {
        self.prefetched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(path)
    }
}

impl Datastore for EtcdDatastore {
    async fn prefetch(&self, keys: &[Key]) {
        self.prefetch_keys(keys).await
    }

    async fn get(&self, key: &Key) -> Result<KvPair, DatastoreError> {
        let path = key_path(key);
        match self.take_prefetched(&path) {
            Some(Some(kv)) => return Ok(kv),
            Some(None) => return Err(DatastoreError::not_found(key)),
            None => {}
        }
        let resp = self.range(format!("get {path}"), path, false).await?;
        match resp.kvs().first() {
            Some(item) => to_pair(key.clone(), item),
            None => Err(DatastoreError::not_found(key)),
        }
    }

    async fn list(&self, what: &ListKind) -> Result<Vec<KvPair>, DatastoreError> {
        let prefix = list_prefix(what);
        let resp = self
            .range(format!("list {prefix}"), prefix.clone(), true)
            .await?;
        let mut out = Vec::with_capacity(resp.kvs().len());
        for item in resp.kvs() {
            let Ok(path) = item.key_str() else { continue };
            if let Some(key) = key_from_path(what, path) {
                out.push(to_pair(key, item)?);
            }
        }
        Ok(out)
    }

    async fn create(&self, key: &Key, value: &Value) -> Result<Revision, DatastoreError> {
        let path = key_path(key);
        self.take_prefetched(&path);
        let bytes = encode_value(key, value)?;
        let txn = Txn::new()
            .when(vec![Compare::version(path.clone(), CompareOp::Equal, 0)])
            .and_then(vec![TxnOp::put(path.clone(), bytes.clone(), None)])
            .or_else(vec![TxnOp::get(path, None)]);
        let (resp, attempts) = self.txn_counted(&key_path(key), txn).await?;
        if !resp.succeeded() {
            if attempts > 1 {
                if let Some(rev) = already_applied(&resp, &bytes) {
                    return Ok(rev);
                }
            }
            return Err(DatastoreError::AlreadyExists(key.describe()));
        }
        Ok(header_revision(&resp))
    }

    async fn update(
        &self,
        key: &Key,
        value: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        let path = key_path(key);
        let rev = parse_rev(key, revision)?;
        self.take_prefetched(&path);
        let bytes = encode_value(key, value)?;
        let txn = Txn::new()
            .when(vec![Compare::mod_revision(
                path.clone(),
                CompareOp::Equal,
                rev,
            )])
            .and_then(vec![TxnOp::put(path.clone(), bytes.clone(), None)])
            .or_else(vec![TxnOp::get(path, None)]);
        let (resp, attempts) = self.txn_counted(&key_path(key), txn).await?;
        if !resp.succeeded() {
            if attempts > 1 {
                if let Some(rev) = already_applied(&resp, &bytes) {
                    return Ok(rev);
                }
            }
            return Err(failed_compare(key, &resp));
        }
        Ok(header_revision(&resp))
    }

    async fn delete(&self, key: &Key, revision: Option<&str>) -> Result<(), DatastoreError> {
        let path = key_path(key);
        self.take_prefetched(&path);
        let mut compares = Vec::new();
        if let Some(r) = revision.filter(|r| !r.is_empty()) {
            compares.push(Compare::mod_revision(
                path.clone(),
                CompareOp::Equal,
                parse_rev(key, r)?,
            ));
        }
        let txn = Txn::new()
            .when(compares)
            .and_then(vec![TxnOp::delete(path.clone(), None)])
            .or_else(vec![TxnOp::get(path, None)]);
        let (resp, attempts) = self.txn_counted(&key_path(key), txn).await?;
        let outcome = if !resp.succeeded() {
            Err(failed_compare(key, &resp))
        } else if resp.op_responses().iter().any(|r| match r {
            TxnOpResponse::Delete(d) => d.deleted() > 0,
            _ => false,
        }) {
            Ok(())
        } else {
            Err(DatastoreError::not_found(key))
        };
        match outcome {
            // Retried after a lost answer: the first attempt deleted it.
            Err(DatastoreError::NotFound { .. }) if attempts > 1 => Ok(()),
            other => other,
        }
    }

    /// One transaction: `If(version(create) == 0 && mod_revision(update) == rev) Put both
    /// Else Get both`.
    async fn create_and_update(
        &self,
        (ckey, cvalue): (&Key, &Value),
        (ukey, uvalue, revision): (&Key, &Value, &str),
    ) -> Option<Result<Revision, DatastoreError>> {
        Some(self.pair_txn(ckey, cvalue, ukey, uvalue, revision).await)
    }
}

impl EtcdDatastore {
    async fn pair_txn(
        &self,
        ckey: &Key,
        cvalue: &Value,
        ukey: &Key,
        uvalue: &Value,
        revision: &str,
    ) -> Result<Revision, DatastoreError> {
        let (cpath, upath) = (key_path(ckey), key_path(ukey));
        self.take_prefetched(&cpath);
        self.take_prefetched(&upath);
        let rev = parse_rev(ukey, revision)?;
        let (cbytes, ubytes) = (encode_value(ckey, cvalue)?, encode_value(ukey, uvalue)?);
        let txn = Txn::new()
            .when(vec![
                Compare::version(cpath.clone(), CompareOp::Equal, 0),
                Compare::mod_revision(upath.clone(), CompareOp::Equal, rev),
            ])
            .and_then(vec![
                TxnOp::put(cpath.clone(), cbytes.clone(), None),
                TxnOp::put(upath.clone(), ubytes.clone(), None),
            ])
            .or_else(vec![
                TxnOp::get(cpath.clone(), None),
                TxnOp::get(upath.clone(), None),
            ]);
        let (resp, attempts) = self.txn_counted(&format!("{cpath} + {upath}"), txn).await?;
        if resp.succeeded() {
            return Ok(header_revision(&resp));
        }
        // The Else gets, in order: the created key, the updated key.
        let answers = resp.op_responses();
        let stored: Vec<Option<&KeyValue>> = answers
            .iter()
            .map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first(),
                _ => None,
            })
            .collect();
        let created = stored.first().copied().flatten();
        let updated = stored.get(1).copied().flatten();
        // Retried after a lost answer, and both keys hold what we wrote: it was applied.
        if attempts > 1 {
            if let (Some(c), Some(u)) = (created, updated) {
                if c.value() == cbytes && u.value() == ubytes {
                    return Ok(u.mod_revision().to_string());
                }
            }
        }
        Err(match (created, updated) {
            (Some(_), _) => DatastoreError::AlreadyExists(ckey.describe()),
            (None, Some(_)) => DatastoreError::Conflict(ukey.describe()),
            (None, None) => DatastoreError::not_found(ukey),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datastore::Kind;

    /// A port nothing listens on: the request fails to connect and is retried at once; a
    /// timeout, or etcd's own answer, is not a refused connection.
    #[tokio::test]
    async fn a_refused_connection_is_told_apart() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let client = Client::connect([format!("http://127.0.0.1:{port}")], None)
            .await
            .unwrap();
        let err = client.kv_client().get("k", None).await.unwrap_err();
        assert!(is_transport_error(&err), "{err}");
        assert!(is_refused_connection(&err), "{err}");
        let other = etcd_client::Error::GRpcStatus(tonic::Status::unavailable("leader changed"));
        assert!(!is_refused_connection(&other));
        assert!(!is_refused_connection(&etcd_client::Error::InvalidArgs(
            "x".into()
        )));
    }

    #[test]
    fn key_paths() {
        let cidr: IpNet = "10.244.166.128/26".parse().unwrap();
        assert_eq!(
            key_path(&Key::Block { cidr }),
            "/calico/ipam/v2/assignment/ipv4/block/10.244.166.128-26"
        );
        let v6: IpNet = "fd00:10:244::/122".parse().unwrap();
        assert_eq!(
            key_path(&Key::Block { cidr: v6 }),
            "/calico/ipam/v2/assignment/ipv6/block/fd00:10:244::-122"
        );
        assert_eq!(
            key_path(&Key::host_affinity("node1", cidr)),
            "/calico/ipam/v2/host/node1/ipv4/block/10.244.166.128-26"
        );
        assert_eq!(
            key_path(&Key::Handle {
                id: "k8s-pod-network.ABC".into()
            }),
            "/calico/ipam/v2/handle/k8s-pod-network.ABC"
        );
        assert_eq!(key_path(&Key::IpamConfig), "/calico/ipam/v2/config");
        assert_eq!(
            key_path(&Key::resource(
                Kind::WorkloadEndpoint,
                Some("default"),
                "n-k8s-p-eth0"
            )),
            "/calico/resources/v3/projectcalico.org/workloadendpoints/default/n-k8s-p-eth0"
        );
        assert_eq!(
            key_path(&Key::resource(Kind::IpPool, None, "pool1")),
            "/calico/resources/v3/projectcalico.org/ippools/pool1"
        );
    }

    #[test]
    fn list_prefixes_and_key_recovery() {
        let wep = ListKind::Resources {
            kind: Kind::WorkloadEndpoint,
            namespace: Some("default".into()),
            name_prefix: Some("node1-k8s-pod-".into()),
        };
        assert_eq!(
            list_prefix(&wep),
            "/calico/resources/v3/projectcalico.org/workloadendpoints/default/node1-k8s-pod-"
        );
        assert_eq!(
            key_from_path(
                &wep,
                "/calico/resources/v3/projectcalico.org/workloadendpoints/default/node1-k8s-pod-eth0"
            ),
            Some(Key::resource(Kind::WorkloadEndpoint, Some("default"), "node1-k8s-pod-eth0"))
        );
        let aff = ListKind::Affinities {
            host: "node1".into(),
            affinity_type: "host".into(),
            version: Some(6),
        };
        assert_eq!(list_prefix(&aff), "/calico/ipam/v2/host/node1/ipv6/block/");
        assert_eq!(
            key_from_path(&aff, "/calico/ipam/v2/host/node1/ipv6/block/fd00::-122"),
            Some(Key::host_affinity("node1", "fd00::/122".parse().unwrap()))
        );
        let blocks = ListKind::Blocks { version: None };
        assert_eq!(
            key_from_path(&blocks, "/calico/ipam/v2/assignment/ipv4/block/10.0.0.0-26"),
            Some(Key::Block {
                cidr: "10.0.0.0/26".parse().unwrap()
            })
        );
    }
}
