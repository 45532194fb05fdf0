//! Test fixture: a private etcd (Debian's `/usr/bin/etcd` 3.4) on 127.0.0.1 with free ports and
//! a temp data dir, optionally inside a network namespace (loopback is per netns) and
//! optionally with TLS (client certificates required). Killed by PID and cleaned up on drop.
#![allow(dead_code)]

use std::fs;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use calico_cni::datastore::etcd::{EtcdConfig, EtcdDatastore};

const ETCD: &str = "/usr/bin/etcd";
const ETCDCTL: &str = "/usr/bin/etcdctl";
const START_TIMEOUT: Duration = Duration::from_secs(20);

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// PEM files for a TLS etcd: the CA, and a client certificate and key it accepts.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: String,
    pub cert: String,
    pub key: String,
}

/// Our etcd backend on `endpoint`, each call bounded by `timeout`.
pub async fn connect(endpoint: &str, timeout: Duration) -> EtcdDatastore {
    EtcdDatastore::connect(&EtcdConfig {
        endpoints: vec![endpoint.to_string()],
        timeout,
        ..Default::default()
    })
    .await
    .unwrap()
}

/// A running etcd.
pub struct EtcdServer {
    child: Child,
    dir: PathBuf,
    port: u16,
    netns: Option<String>,
    tls: Option<TlsFiles>,
    user: Option<(String, String)>,
    /// Whether Drop removes `dir` (not while start-up may still retry in it).
    owns_dir: bool,
}

/// Two distinct free ports on the host's loopback. In a fresh netns nothing listens at all,
/// so they are free there too.
fn free_ports() -> (u16, u16) {
    let a = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let b = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    (
        a.local_addr().unwrap().port(),
        b.local_addr().unwrap().port(),
    )
}

fn temp_dir() -> PathBuf {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    let dir = std::env::temp_dir().join(format!(
        "calico-etcd-test-{}-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst),
        nanos
    ));
    fs::create_dir_all(&dir).expect("create etcd temp dir");
    dir
}

/// A command, run inside `netns` when given (`ip netns exec` execs it, keeping the PID).
fn command_in(netns: Option<&str>, program: &str) -> Command {
    match netns {
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, program]);
            c
        }
        None => Command::new(program),
    }
}

fn run_openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "openssl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A throw-away CA plus server (127.0.0.1) and client certificates, EC P-256.
fn make_certs(dir: &Path) -> (TlsFiles, String, String) {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut ca = vec![
        "req",
        "-x509",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=etcd-test-ca",
    ];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    run_openssl(dir, &ca);
    fs::write(
        dir.join("server.ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
    for (name, cn) in [("server", "127.0.0.1"), ("client", "calico-cni")] {
        let subj = format!("/CN={cn}");
        let key = format!("{name}.key");
        let csr = format!("{name}.csr");
        let pem = format!("{name}.pem");
        let ext = format!("{name}.ext");
        let mut req = vec!["req", "-nodes", "-subj", &subj];
        req.extend(ec);
        req.extend(["-keyout", &key, "-out", &csr]);
        run_openssl(dir, &req);
        run_openssl(
            dir,
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &pem,
            ],
        );
    }
    let p = |f: &str| dir.join(f).to_string_lossy().into_owned();
    (
        TlsFiles {
            ca: p("ca.pem"),
            cert: p("client.pem"),
            key: p("client.key"),
        },
        p("server.pem"),
        p("server.key"),
    )
}

impl EtcdServer {
    /// Starts etcd on the host's loopback.
    pub fn start() -> EtcdServer {
        Self::start_with(None, false)
    }

    /// Starts etcd inside the named network namespace (or on the host for `None`).
    pub fn start_in_netns(netns_name: Option<&str>) -> EtcdServer {
        Self::start_with(netns_name, false)
    }

    /// Starts an etcd that serves https only and requires client certificates.
    pub fn start_tls() -> EtcdServer {
        Self::start_with(None, true)
    }

    fn start_with(netns: Option<&str>, tls: bool) -> EtcdServer {
        let dir = temp_dir();
        let certs = tls.then(|| make_certs(&dir));
        // A port grabbed by someone else between probing and etcd's bind makes etcd exit at
        // once; retry with fresh ports.
        let mut last_log = String::new();
        for attempt in 0..3 {
            let (port, peer) = free_ports();
            let data = dir.join(format!("data{attempt}"));
            let log = dir.join(format!("etcd{attempt}.log"));
            let scheme = if tls { "https" } else { "http" };
            let client_url = format!("{scheme}://127.0.0.1:{port}");
            // In a netns of its own, on all of its addresses: a second node reaches it over
            // the node link (real_node.rs's `NodePair`).
            let listen_url = match netns {
                Some(_) => format!("{scheme}://0.0.0.0:{port}"),
                None => client_url.clone(),
            };
            let peer_url = format!("http://127.0.0.1:{peer}");
            let logf = fs::File::create(&log).expect("create etcd log");
            let mut cmd = command_in(netns, ETCD);
            cmd.arg("--name")
                .arg("test")
                .arg("--data-dir")
                .arg(&data)
                .arg("--listen-client-urls")
                .arg(&listen_url)
                .arg("--advertise-client-urls")
                .arg(&client_url)
                .arg("--listen-peer-urls")
                .arg(&peer_url)
                .arg("--initial-advertise-peer-urls")
                .arg(&peer_url)
                .arg("--initial-cluster")
                .arg(format!("test={peer_url}"))
                .args(["--logger=zap", "--log-level=error"]);
            if let Some((_, cert, key)) = &certs {
                cmd.args(["--cert-file", cert, "--key-file", key])
                    .args(["--trusted-ca-file", &certs.as_ref().unwrap().0.ca])
                    .arg("--client-cert-auth");
            }
            let child = cmd
                .stdin(Stdio::null())
                .stdout(logf.try_clone().unwrap())
                .stderr(logf)
                .spawn()
                .unwrap_or_else(|e| panic!("failed to start {ETCD}: {e}"));
            let mut server = EtcdServer {
                child,
                dir: dir.clone(),
                port,
                netns: netns.map(str::to_string),
                tls: certs.as_ref().map(|c| c.0.clone()),
                user: None,
                owns_dir: false,
            };
            let result = server.wait_healthy();
            if result.is_ok() {
                server.owns_dir = true;
                return server;
            }
            drop(server); // kills this attempt's etcd, keeps the dir
            last_log = fs::read_to_string(&log).unwrap_or_default();
            if result == Err(false) {
                let _ = fs::remove_dir_all(&dir);
                panic!(
                    "etcd did not become healthy within {START_TIMEOUT:?} (netns {netns:?}); \
                     log:\n{last_log}"
                );
            }
        }
        let _ = fs::remove_dir_all(&dir);
        panic!("etcd exited during start-up three times (netns {netns:?}); last log:\n{last_log}");
    }

    /// Polls `etcdctl endpoint health`; `Err(true)` if etcd exited, `Err(false)` on timeout.
    fn wait_healthy(&mut self) -> Result<(), bool> {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return Err(true);
            }
            let out = self.etcdctl_output(&[
                "endpoint",
                "health",
                "--dial-timeout=1s",
                "--command-timeout=1s",
            ]);
            if out.status.success() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(false)
    }

    /// `http://127.0.0.1:PORT` (`https://` for a TLS server).
    pub fn endpoint(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The etcd PID (etcd's own, also when started through `ip netns exec`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Freezes etcd (SIGSTOP): connections stay open and requests are accepted by the
    /// kernel but never answered, as with a hung or overloaded member.
    pub fn freeze(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a frozen etcd go on (SIGCONT); it then answers what was queued.
    pub fn thaw(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: libc::c_int) {
        signal_pid(self.child.id(), sig);
    }

    /// Freezes etcd the moment a key under `prefix` is written: an `etcdctl watch` whose
    /// reader sends SIGSTOP on the first such event. The write itself has been applied (its
    /// writer may or may not have its answer); whatever is sent next waits. The watch is
    /// known to be live before this returns (a sentinel key under `prefix` is seen, then
    /// deleted), so it must be one no reader of `prefix` takes for one of its own.
    pub fn freeze_on_write(&self, prefix: &str) -> WriteTrap {
        let mut child = self
            .etcdctl_cmd(&["watch", "--prefix", prefix])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("failed to run {ETCDCTL} watch: {e}"));
        let stdout = child.stdout.take().expect("piped stdout");
        let sentinel = format!("{prefix}~write-trap");
        let fired = Arc::new(AtomicBool::new(false));
        let (seen_tx, seen_rx) = mpsc::channel();
        let (etcd_pid, flag, watched, marker) = (
            self.child.id(),
            fired.clone(),
            prefix.to_string(),
            sentinel.clone(),
        );
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line == marker {
                    let _ = seen_tx.send(());
                } else if line.starts_with(&watched) && !flag.swap(true, Ordering::SeqCst) {
                    signal_pid(etcd_pid, libc::SIGSTOP);
                }
            }
        });
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            self.put(&sentinel, "{}");
            if seen_rx.recv_timeout(Duration::from_millis(200)).is_ok() {
                break;
            }
            assert!(
                Instant::now() < until,
                "etcdctl watch on {prefix} never saw a write"
            );
        }
        self.etcdctl(&["del", "--", &sentinel]);
        WriteTrap { child, fired }
    }

    /// The client TLS files of a TLS server.
    pub fn tls_files(&self) -> Option<TlsFiles> {
        self.tls.clone()
    }

    /// Creates a `root` user with `password`, enables authentication and uses the user for
    /// later `etcdctl` calls.
    pub fn enable_auth(&mut self, password: &str) {
        self.etcdctl(&["user", "add", "root", "--new-user-password", password]);
        self.etcdctl(&["auth", "enable"]);
        self.user = Some(("root".into(), password.into()));
    }

    /// Runs `etcdctl` (API v3) against this server, in its netns; the raw output.
    pub fn etcdctl_output(&self, args: &[&str]) -> Output {
        self.etcdctl_cmd(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("failed to run {ETCDCTL}: {e}"))
    }

    fn etcdctl_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = command_in(self.netns.as_deref(), ETCDCTL);
        cmd.env("ETCDCTL_API", "3")
            .env_remove("ETCDCTL_ENDPOINTS")
            .arg(format!("--endpoints={}", self.endpoint()));
        if let Some(t) = &self.tls {
            cmd.arg(format!("--cacert={}", t.ca))
                .arg(format!("--cert={}", t.cert))
                .arg(format!("--key={}", t.key));
        }
        if let Some((u, p)) = &self.user {
            cmd.arg(format!("--user={u}:{p}"));
        }
        cmd.args(args);
        cmd
    }

    /// Runs `etcdctl` and returns its stdout; panics (with stderr) when it fails.
    pub fn etcdctl(&self, args: &[&str]) -> String {
        let out = self.etcdctl_output(args);
        assert!(
            out.status.success(),
            "etcdctl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("etcdctl output is UTF-8")
    }

    /// The stored value of `key` exactly as bytes-in-a-string, `None` when absent.
    pub fn get_raw(&self, key: &str) -> Option<String> {
        // Simple format: the key line, then the value line (our values have no newlines).
        let out = self.etcdctl(&["get", "--", key]);
        let (_, value) = out.split_once('\n')?;
        Some(value.strip_suffix('\n').unwrap_or(value).to_string())
    }

    /// The stored value of `key` parsed as JSON; panics when absent or not JSON.
    pub fn get_json(&self, key: &str) -> serde_json::Value {
        let raw = self
            .get_raw(key)
            .unwrap_or_else(|| panic!("etcd key {key} does not exist"));
        serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{key} holds non-JSON {raw:?}: {e}"))
    }

    /// The ModRevision of `key`; panics when absent.
    pub fn mod_revision(&self, key: &str) -> i64 {
        let out = self.etcdctl(&["get", "-w", "fields", "--", key]);
        out.lines()
            .find_map(|l| l.strip_prefix("\"ModRevision\" : "))
            .unwrap_or_else(|| panic!("etcd key {key} does not exist"))
            .trim()
            .parse()
            .expect("numeric ModRevision")
    }

    /// The store's current revision.
    pub fn revision(&self) -> i64 {
        let out = self.etcdctl(&["get", "-w", "json", "--", "/"]);
        let v: serde_json::Value = serde_json::from_str(&out).expect("etcdctl's JSON");
        v["header"]["revision"].as_i64().expect("numeric revision")
    }

    /// Every value `key` held at the revisions after `since`, oldest first, read back
    /// from etcd's history (never compacted here): what was written there and then
    /// removed is seen too.
    pub fn values_since(&self, key: &str, since: i64) -> Vec<serde_json::Value> {
        let mut seen: Vec<(i64, serde_json::Value)> = Vec::new();
        for rev in since + 1..=self.revision() {
            let at = format!("--rev={rev}");
            let out = self.etcdctl(&["get", "-w", "json", &at, "--", key]);
            let v: serde_json::Value = serde_json::from_str(&out).expect("etcdctl's JSON");
            let Some(kv) = v["kvs"].as_array().and_then(|k| k.first()) else {
                continue;
            };
            let modified = kv["mod_revision"].as_i64().expect("numeric mod_revision");
            if seen.last().is_some_and(|(m, _)| *m == modified) || modified <= since {
                continue;
            }
            let raw = self.etcdctl(&["get", "--print-value-only", &at, "--", key]);
            let value = serde_json::from_str(raw.trim_end()).expect("a JSON value");
            seen.push((modified, value));
        }
        seen.into_iter().map(|(_, v)| v).collect()
    }

    /// Writes `value` (verbatim; may be empty) at `key`.
    pub fn put(&self, key: &str, value: &str) {
        // After `--` neither an empty value nor a leading dash is taken for a flag.
        self.etcdctl(&["put", "--", key, value]);
    }

    /// All keys under `prefix`, in key order.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        self.etcdctl(&["get", "--prefix", "--keys-only", "--", prefix])
            .lines()
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    }

    /// Deletes everything under `prefix`.
    pub fn delete_prefix(&self, prefix: &str) {
        self.etcdctl(&["del", "--prefix", "--", prefix]);
    }

    /// Every (key, value) under `prefix`, in one etcdctl call (values are one-line JSON).
    pub fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        key_value_lines(&self.etcdctl(&["get", "--prefix", prefix]))
    }

    /// etcd's own count of the KV requests it has answered, by method (`Range`, `Txn`, …),
    /// from its `/metrics` (plain HTTP on the client port; not for TLS servers).
    pub fn kv_requests(&self) -> std::collections::BTreeMap<String, u64> {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", self.port()))
            .expect("connect to etcd's metrics");
        conn.set_read_timeout(Some(Duration::from_secs(10))).ok();
        conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .expect("ask etcd for its metrics");
        let mut text = String::new();
        conn.read_to_string(&mut text).expect("read etcd's metrics");
        let mut out = std::collections::BTreeMap::new();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("grpc_server_handled_total{") else {
                continue;
            };
            if !rest.contains("grpc_service=\"etcdserverpb.KV\"") {
                continue;
            }
            let method = rest
                .split("grpc_method=\"")
                .nth(1)
                .and_then(|m| m.split('"').next())
                .unwrap_or_default();
            let n: u64 = line
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            *out.entry(method.to_string()).or_insert(0) += n;
        }
        out
    }
}

fn signal_pid(pid: u32, sig: libc::c_int) {
    let pid = libc::pid_t::try_from(pid).expect("etcd PID fits pid_t");
    // SAFETY: kill(2) on the PID of an etcd a fixture started and has not reaped.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
}

/// See [`EtcdServer::freeze_on_write`]; the watch is killed on drop.
pub struct WriteTrap {
    child: Child,
    fired: Arc<AtomicBool>,
}

impl WriteTrap {
    /// Whether etcd was frozen.
    pub fn fired(&self) -> bool {
        self.fired.load(Ordering::SeqCst)
    }
}

impl Drop for WriteTrap {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        // SIGKILL by PID: the child is etcd itself (also via `ip netns exec`).
        let _ = self.child.kill();
        let _ = self.child.wait();
        if self.owns_dir {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// A multi-member etcd cluster on loopback (for fault tests), killed on drop.
pub struct EtcdCluster {
    members: Vec<(Child, u16)>,
    /// The members' logs.
    dir: super::cni::TempDir,
    /// The members' data dirs, on tmpfs when there is one ([`memory_backed_dir`]).
    data: PathBuf,
}

/// A fresh directory on tmpfs (/dev/shm) for a cluster's data dirs, or `fallback` where
/// there is no tmpfs. Each member fdatasyncs its WAL before it sends a vote request, answers
/// one, or acknowledges an entry. On a disk shared with builds and other suites one sync can
/// take longer than the election timeout (1 s): a cluster that has lost a member then has no
/// member to spare, so the two survivors' vote requests, each sent only after its own sync,
/// cross into split votes, and a leader elected loses its one follower's answers and steps
/// down (check-quorum) -- elections over and over, no leader for as long as the disk is slow.
/// The fault tests are about the plugin riding out a member's loss, not about etcd's disk.
/// Each member takes about 130 MB there (two WAL segments of 64 MB, preallocated), so a
/// small /dev/shm (a container's 64 MB) is passed over.
fn memory_backed_dir(fallback: &Path, members: usize) -> PathBuf {
    const PER_MEMBER: u64 = 192 << 20;
    let shm = c"/dev/shm";
    // SAFETY: statfs(2) of a NUL-terminated path into a zeroed struct of the size it writes.
    let (is_tmpfs, free) = unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        let ok = libc::statfs(shm.as_ptr(), &mut st) == 0;
        let block = u64::try_from(st.f_bsize).unwrap_or(0);
        (
            ok && st.f_type == libc::TMPFS_MAGIC,
            st.f_bavail.saturating_mul(block),
        )
    };
    let on_tmpfs = is_tmpfs && free >= PER_MEMBER * members as u64;
    let dir = Path::new("/dev/shm").join(format!(
        "calico-etcd-cluster-{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::SeqCst)
    ));
    if on_tmpfs && fs::create_dir_all(&dir).is_ok() {
        return dir;
    }
    eprintln!(
        "etcd cluster: no tmpfs with {} MB free at /dev/shm, data on disk (a busy disk can \
         leave the survivors of a member's loss without a leader)",
        (PER_MEMBER * members as u64) >> 20
    );
    fallback.join("data")
}

/// What a member's whole log says of its elections and its disk (the tail printed after it
/// may start after the elections that matter).
fn raft_summary(log: &str) -> String {
    let count = |what: &str| log.lines().filter(|l| l.contains(what)).count();
    let millis = |t: &str| match t.strip_suffix("ms") {
        Some(ms) => ms.parse::<f64>().ok(),
        None => t
            .strip_suffix('s')
            .and_then(|s| s.parse::<f64>().ok())
            .map(|s| s * 1000.0),
    };
    let slowest_sync = log
        .lines()
        .filter(|l| l.contains("\"slow fdatasync\""))
        .filter_map(|l| millis(l.split("\"took\":\"").nth(1)?.split('"').next()?))
        .fold(0.0, f64::max);
    let mut out = format!(
        "{} elections started, {} leaders elected, {} leaders lost, {} vote requests refused, \
         {} slow fdatasyncs (slowest {slowest_sync:.0} ms), {} late heartbeats",
        count("is starting a new election"),
        count("elected leader"),
        count("lost leader"),
        count("rejected MsgVote"),
        count("\"slow fdatasync\""),
        count("failed to send out heartbeat on time"),
    );
    let elections: Vec<&str> = log
        .lines()
        .filter(|l| {
            [
                "became candidate",
                "became leader",
                "elected leader",
                "lost leader",
            ]
            .iter()
            .any(|m| l.contains(m))
        })
        .collect();
    for l in &elections[elections.len().saturating_sub(20)..] {
        out.push('\n');
        out.push_str(l);
    }
    out
}

impl EtcdCluster {
    pub fn start(size: usize) -> EtcdCluster {
        let dir = super::cni::TempDir::new("etcd-cluster");
        let data = memory_backed_dir(dir.path(), size);
        let ports: Vec<(u16, u16)> = (0..size).map(|_| free_ports()).collect();
        let initial = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect::<Vec<_>>()
            .join(",");
        let mut members = Vec::new();
        for (i, (port, peer)) in ports.iter().enumerate() {
            let client_url = format!("http://127.0.0.1:{port}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let child = Command::new("etcd")
                .args(["--name", &format!("m{i}"), "--data-dir"])
                .arg(data.join(format!("m{i}")))
                .args([
                    "--listen-client-urls",
                    &client_url,
                    "--advertise-client-urls",
                    &client_url,
                ])
                .args([
                    "--listen-peer-urls",
                    &peer_url,
                    "--initial-advertise-peer-urls",
                    &peer_url,
                ])
                .args([
                    "--initial-cluster",
                    &initial,
                    "--initial-cluster-state",
                    "new",
                ])
                // A log per member, its tail printed if the test fails (elections, slow
                // fsyncs and peer errors say why a member loss was not hidden).
                .args(["--logger=zap", "--log-level=info"])
                .stdout(Stdio::null())
                .stderr(
                    fs::File::create(dir.path().join(format!("m{i}.log")))
                        .expect("create etcd member log"),
                )
                .spawn()
                .expect("start etcd member");
            members.push((child, *port));
        }
        let c = EtcdCluster { members, dir, data };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !c.healthy() {
            assert!(
                Instant::now() < deadline,
                "etcd cluster did not become healthy"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        c
    }

    fn healthy(&self) -> bool {
        Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.endpoints_csv(), "endpoint", "health"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    /// `http://127.0.0.1:a,http://127.0.0.1:b,...` (the `etcd_endpoints` form).
    pub fn endpoints_csv(&self) -> String {
        self.members
            .iter()
            .map(|(_, p)| format!("http://127.0.0.1:{p}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// A single-member handle for etcdctl reads (`get_prefix`, `put`) through member `i`.
    pub fn ctl(&self, i: usize, args: &[&str]) -> String {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &format!("127.0.0.1:{}", self.members[i].1)])
            .args(args)
            .output()
            .expect("etcdctl");
        assert!(
            out.status.success(),
            "etcdctl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILLs member `i`.
    pub fn kill(&mut self, i: usize) {
        let _ = self.members[i].0.kill();
        let _ = self.members[i].0.wait();
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // Who leads, by each member that still answers.
            let status = Command::new("etcdctl")
                .env("ETCDCTL_API", "3")
                .args(["--endpoints", &self.endpoints_csv()])
                .args(["--command-timeout=2s", "endpoint", "status", "-w", "table"])
                .output();
            if let Ok(o) = status {
                eprintln!(
                    "--- etcd endpoint status ---\n{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                );
            }
        }
        for (c, _) in &mut self.members {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = fs::remove_dir_all(&self.data);
        if std::thread::panicking() {
            for i in 0..self.members.len() {
                let log = fs::read_to_string(self.dir.path().join(format!("m{i}.log")))
                    .unwrap_or_default();
                eprintln!("--- etcd member m{i}: {}", raft_summary(&log));
                let lines: Vec<&str> = log.lines().collect();
                let tail = &lines[lines.len().saturating_sub(80)..];
                eprintln!("--- etcd member m{i}: last {} log lines ---", tail.len());
                for l in tail {
                    eprintln!("{l}");
                }
            }
        }
    }
}

/// etcdctl's `get` output: a key line, then its (one-line) value.
pub fn key_value_lines(out: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = out.lines().collect();
    lines
        .chunks(2)
        .filter(|c| c.len() == 2)
        .map(|c| (c[0].to_string(), c[1].to_string()))
        .collect()
}
