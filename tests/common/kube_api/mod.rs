//! Test fixture: a Kubernetes API server stand-in for the end-to-end suites (no
//! kube-apiserver can be installed here). Real HTTPS on 127.0.0.1 (a CA and server
//! certificate made per start, ALPN `h2` and `http/1.1`), bearer-token auth, and the REST
//! semantics a Calico client relies on for core pods/namespaces/nodes and Calico's CRDs
//! (`store.rs`), with the real server's error bodies. It records every request, counts TLS
//! handshakes, and injects faults (stall, canned failures).
//!
//! The server runs on its own thread and tokio runtime, so plain synchronous tests can use
//! it while they exec the plugin binary; dropping the handle stops it.
#![allow(dead_code)]

mod list;
mod patch;
mod resource;
mod selector;
mod status;
mod store;
mod validate;

use std::convert::Infallible;
use std::fs;
use std::io::Read;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{json, Value};
use tokio_rustls::rustls;

use super::cni::TempDir;
use status::{ApiError, Reply};
use store::State;

/// One request as the server saw it.
#[derive(Clone, Debug)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// The raw query string, without `?`.
    pub query: String,
    pub content_type: String,
    pub body: String,
    /// "HTTP/2.0" or "HTTP/1.1".
    pub version: String,
    /// Which connection (1-based, in handshake order) carried it.
    pub connection: usize,
    /// The answer's status; 0 while unanswered (a stalled request stays at 0).
    pub status: u16,
}

/// State shared between the handle and the server thread.
struct Shared {
    token: String,
    state: Mutex<State>,
    /// (sequence number, request): the number finds a request again once answered.
    requests: Mutex<Vec<(usize, Recorded)>>,
    seq: AtomicUsize,
    /// The ALPN protocol of each connection ("" when none), in handshake order.
    protocols: Mutex<Vec<String>>,
    stall: AtomicBool,
    /// Milliseconds every answer is held back (a network round trip to a remote server).
    latency_ms: AtomicUsize,
    /// (requests left to fail, status code).
    fail: Mutex<(usize, u16)>,
    /// One-shot failures of chosen requests (`fail_one`), in the order armed.
    fail_one: Mutex<Vec<FailOne>>,
}

/// `fail_one`'s rule: the request after `skip` more matching ones fails with `code`.
struct FailOne {
    method: String,
    path: String,
    skip: usize,
    code: u16,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running test API server.
pub struct KubeApi {
    shared: Arc<Shared>,
    port: u16,
    ca_pem: String,
    dir: TempDir,
    kubeconfigs: AtomicUsize,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KubeApi {
    /// Serves core v1 and crd.projectcalico.org/v1.
    pub fn start() -> KubeApi {
        KubeApi::start_groups(&[])
    }

    /// Also serves Calico's resources under `group_version` (e.g. "projectcalico.org/v3",
    /// where IPAMConfig is `ipamconfigurations`), as custom resources.
    pub fn start_with_group(group_version: &str) -> KubeApi {
        KubeApi::start_groups(&[group_version])
    }

    /// Serves from inside a network namespace (its loopback), so that a plugin run in that
    /// namespace reaches it at 127.0.0.1: the listener is bound by a thread that entered it.
    pub fn start_in_netns(netns_path: &str) -> KubeApi {
        KubeApi::start_in_netns_on(netns_path, "127.0.0.1")
    }

    /// `start_in_netns`, listening on `bind` (`0.0.0.0`: every address of the netns, so that
    /// a client can reach it at one that is not loopback). Its kubeconfig still names
    /// 127.0.0.1, the name its certificate is for.
    pub fn start_in_netns_on(netns_path: &str, bind: &str) -> KubeApi {
        let path = netns_path.to_string();
        let bind = format!("{bind}:0");
        let listener = std::thread::spawn(move || {
            let ns = fs::File::open(&path).expect("open the netns");
            nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("enter the netns");
            std::net::TcpListener::bind(&bind).expect("bind in the netns")
        })
        .join()
        .expect("bind thread");
        KubeApi::start_on(&[], listener)
    }

    fn start_groups(extra: &[&str]) -> KubeApi {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        KubeApi::start_on(extra, listener)
    }

    fn start_on(extra: &[&str], listener: std::net::TcpListener) -> KubeApi {
        let mut resources = resource::core_resources();
        resources.extend(resource::calico_resources("crd.projectcalico.org/v1"));
        for gv in extra {
            resources.extend(resource::calico_resources(gv));
        }
        let (ca_pem, tls) = tls_config();
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let shared = Arc::new(Shared {
            token: hex(&random_bytes::<16>()),
            state: Mutex::new(State::new(resources)),
            requests: Mutex::new(vec![]),
            seq: AtomicUsize::new(0),
            protocols: Mutex::new(vec![]),
            stall: AtomicBool::new(false),
            latency_ms: AtomicUsize::new(0),
            fail: Mutex::new((0, 0)),
            fail_one: Mutex::new(vec![]),
        });
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kube-api-{port}"))
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(serve(listener, tls, server, stopped));
                // Drops every connection task, stalled ones included.
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .expect("spawn the API server thread");
        let api = KubeApi {
            shared,
            port,
            ca_pem,
            dir: TempDir::new("kube-api"),
            kubeconfigs: AtomicUsize::new(0),
            stop: Some(stop),
            thread: Some(thread),
        };
        fs::write(api.ca_path(), &api.ca_pem).unwrap();
        let token = api.token();
        fs::write(api.kubeconfig(), api.kubeconfig_text(&token, false)).unwrap();
        api
    }

    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }
    pub fn port(&self) -> u16 {
        self.port
    }
    pub fn token(&self) -> String {
        self.shared.token.clone()
    }
    pub fn ca_pem(&self) -> String {
        self.ca_pem.clone()
    }
    /// The CA certificate (PEM) in the server's temp dir.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// A kubeconfig (cluster with `certificate-authority-data`, user with the server's
    /// `token`, current-context set) in the server's temp dir.
    pub fn kubeconfig(&self) -> PathBuf {
        self.dir.path().join("kubeconfig")
    }

    /// Another kubeconfig, with `token` and, if `insecure_skip_tls_verify`, no CA data but
    /// `insecure-skip-tls-verify: true`.
    pub fn kubeconfig_with(&self, token: &str, insecure_skip_tls_verify: bool) -> PathBuf {
        let n = self.kubeconfigs.fetch_add(1, Ordering::SeqCst);
        let path = self.dir.path().join(format!("kubeconfig-{n}"));
        fs::write(&path, self.kubeconfig_text(token, insecure_skip_tls_verify)).unwrap();
        path
    }

    fn kubeconfig_text(&self, token: &str, insecure: bool) -> String {
        let trust = if insecure {
            "insecure-skip-tls-verify: true".to_string()
        } else {
            format!(
                "certificate-authority-data: {}",
                calico_cni::install::kubeconfig::base64_std(self.ca_pem.as_bytes())
            )
        };
        format!(
            "apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: {url}
    {trust}
users:
- name: test
  user:
    token: {token}
contexts:
- name: test
  context:
    cluster: test
    user: test
current-context: test
",
            url = self.url()
        )
    }

    /// Every request so far, in arrival order (401s and stalled ones included).
    pub fn requests(&self) -> Vec<Recorded> {
        lock(&self.shared.requests)
            .iter()
            .map(|(_, r)| r.clone())
            .collect()
    }
    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// TLS handshakes completed, one per accepted connection.
    pub fn handshakes(&self) -> usize {
        lock(&self.shared.protocols).len()
    }
    /// The ALPN protocol negotiated on each connection ("h2", "http/1.1", "" for none).
    pub fn protocols(&self) -> Vec<String> {
        lock(&self.shared.protocols).clone()
    }

    /// From now on (until turned off), requests are read but never answered; their
    /// connections stay open until the server is dropped.
    pub fn set_stall(&self, on: bool) {
        self.shared.stall.store(on, Ordering::SeqCst);
    }

    /// Holds every answer back by `latency` (requests in flight together wait together), so
    /// a client's sequential round trips show in its elapsed time.
    pub fn set_latency(&self, latency: Duration) {
        self.shared
            .latency_ms
            .store(latency.as_millis() as usize, Ordering::SeqCst);
    }

    /// The next `n` authenticated requests fail with `code` and a Status body.
    pub fn fail_next(&self, n: usize, code: u16) {
        *lock(&self.shared.fail) = (n, code);
    }

    /// One request with this method and exactly this path fails with `code`: the one after
    /// `skip` more such requests. Rules are independent; a request meets the first armed rule
    /// that matches it. Code 0: that request is read and never answered (a stalled answer).
    pub fn fail_one(&self, method: &str, path: &str, skip: usize, code: u16) {
        lock(&self.shared.fail_one).push(FailOne {
            method: method.into(),
            path: path.into(),
            skip,
            code,
        });
    }

    /// `fail_one` rules that have not fired yet.
    pub fn fail_one_pending(&self) -> usize {
        lock(&self.shared.fail_one).len()
    }

    // Direct store access for fixtures and assertions: no HTTP, not recorded.

    /// Creates or replaces the object at `path`, filling uid, creationTimestamp (unless
    /// given or already stored) and a new resourceVersion like a write.
    pub fn put(&self, path: &str, obj: Value) -> Value {
        lock(&self.shared.state).put(path, obj)
    }
    pub fn get(&self, path: &str) -> Option<Value> {
        lock(&self.shared.state).get(path)
    }
    /// The objects of a collection path in key order, as stored (with kind/apiVersion).
    pub fn list(&self, collection_path: &str) -> Vec<Value> {
        lock(&self.shared.state).list(collection_path)
    }
    pub fn remove(&self, path: &str) {
        lock(&self.shared.state).remove(path)
    }
}

impl Drop for KubeApi {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A CA and a server certificate for 127.0.0.1 and localhost signed by it; returns the CA
/// PEM and the TLS config (ALPN h2, http/1.1).
fn tls_config() -> (String, Arc<rustls::ServerConfig>) {
    let ca = super::test_ca::TestCa::new("kube-api test CA");
    let cert = ca.server_cert("kube-apiserver", &["127.0.0.1", "localhost"]);
    (ca.pem, cert.server_config(&[b"h2", b"http/1.1"]))
}

/// Accepts connections until `stop` fires; each connection gets its own task.
async fn serve(
    listener: std::net::TcpListener,
    tls: Arc<rustls::ServerConfig>,
    shared: Arc<Shared>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    loop {
        let tcp = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => continue,
            },
        };
        // As Go's net/http (the API server's): no Nagle delay on small response frames.
        let _ = tcp.set_nodelay(true);
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        tokio::spawn(async move {
            let Ok(stream) = acceptor.accept(tcp).await else {
                return;
            };
            let alpn = stream.get_ref().1.alpn_protocol().unwrap_or_default();
            let connection = {
                let mut protocols = lock(&shared.protocols);
                protocols.push(String::from_utf8_lossy(alpn).into_owned());
                protocols.len()
            };
            let service =
                hyper::service::service_fn(move |req| answer(shared.clone(), connection, req));
            // HTTP/1.1 or HTTP/2, whichever the client speaks.
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// One request: record it, then stall, reject (401), fail on demand, or answer it.
async fn answer(
    shared: Arc<Shared>,
    connection: usize,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let header = |name: &str| {
        let v = parts.headers.get(name).and_then(|v| v.to_str().ok());
        v.unwrap_or_default().to_string()
    };
    let method = parts.method.to_string();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().unwrap_or_default().to_string();
    let content_type = header("content-type");
    let seq = shared.seq.fetch_add(1, Ordering::SeqCst);
    lock(&shared.requests).push((
        seq,
        Recorded {
            method: method.clone(),
            path: path.clone(),
            query: query.clone(),
            content_type: content_type.clone(),
            body: String::from_utf8_lossy(&body).into_owned(),
            version: format!("{:?}", parts.version),
            connection,
            status: 0,
        },
    ));
    if shared.stall.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    let latency = shared.latency_ms.load(Ordering::SeqCst);
    if latency > 0 {
        tokio::time::sleep(Duration::from_millis(latency as u64)).await;
    }

    // The bearer scheme is case-insensitive; the token is not.
    let auth = header("authorization");
    let authorized = auth.split_once(' ').is_some_and(|(scheme, token)| {
        scheme.eq_ignore_ascii_case("bearer") && token.trim() == shared.token
    });
    let injected = {
        let mut fail = lock(&shared.fail);
        let next = (authorized && fail.0 > 0).then(|| {
            fail.0 -= 1;
            fail.1
        });
        next.or_else(|| {
            let mut rules = lock(&shared.fail_one);
            let i = rules
                .iter()
                .position(|r| authorized && r.method == method.as_str() && r.path == path)?;
            if rules[i].skip > 0 {
                rules[i].skip -= 1;
                return None;
            }
            Some(rules.remove(i).code)
        })
    };
    if injected == Some(0) {
        std::future::pending::<()>().await;
    }
    let reply = if !authorized {
        ApiError::new(401, "Unauthorized", "Unauthorized").reply()
    } else if let Some(code) = injected {
        injected_failure(code)
    } else {
        let mut state = lock(&shared.state);
        state.handle(&method, &path, &query, &content_type, &body)
    };

    if let Some((_, r)) = lock(&shared.requests)
        .iter_mut()
        .rev()
        .find(|(s, _)| *s == seq)
    {
        r.status = reply.status;
    }
    let mut resp = Response::builder()
        .status(reply.status)
        .header("content-type", reply.content_type);
    for (k, v) in &reply.headers {
        resp = resp.header(*k, v);
    }
    Ok(resp.body(Full::new(Bytes::from(reply.body))).unwrap())
}

/// The Status a real server sends with these codes.
fn injected_failure(code: u16) -> Reply {
    let (reason, message) = match code {
        429 => ("TooManyRequests", "Too many requests, please try again later."),
        500 => ("InternalError", "Internal error occurred: injected by the test API server"),
        503 => ("ServiceUnavailable", "the server is currently unable to handle the request"),
        504 => ("Timeout", "the server was unable to return a response in the time allotted, but may still be processing the request"),
        409 => ("Conflict", "the server reported a conflict"),
        _ => ("", "injected failure"),
    };
    let mut e = ApiError::new(code, reason, message);
    if code == 429 {
        e.details = Some(json!({"retryAfterSeconds": 1}));
    }
    let mut reply = e.reply();
    if code == 429 {
        reply.headers.push(("retry-after", "1".into()));
    }
    reply
}

fn random_bytes<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .expect("read /dev/urandom");
    b
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random (version 4) UUID in its text form.
fn new_uid() -> String {
    let mut b = random_bytes::<16>();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex(&b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// The 5 characters `generateName` appends (the real server's alphabet, no vowels).
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let b = random_bytes::<5>();
    b.iter()
        .map(|x| ALPHABET[*x as usize % ALPHABET.len()] as char)
        .collect()
}

/// RFC 3339 in UTC with whole seconds, as metadata timestamps are.
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap().as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    // Days since the epoch to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}
