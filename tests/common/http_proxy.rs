#![allow(dead_code)]
//! Test fixture: a small HTTP proxy inside a test netns, for the plugin's proxy support.
//! `CONNECT host:port` opens a tunnel (to the address [`TestProxy::route`] maps the
//! authority to, else to the authority itself); any other request (an absolute-form
//! `GET http://…`, as a client sends a proxy for an `http://` URL) is answered by the proxy
//! itself with [`TestProxy::answer_with`]'s status. It records every request head, can
//! demand `Proxy-Authorization`, and can be reached over TLS (an `https://` proxy URL).
//!
//! Like the API server fixture it runs on its own thread and tokio runtime; dropping the
//! handle stops it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_rustls::rustls;

use super::netns::Netns;

/// One request as the proxy saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// `CONNECT`, `GET`, …
    pub method: String,
    /// The request target: `host:port` for CONNECT, the whole URL otherwise.
    pub target: String,
    /// The `Proxy-Authorization` header, if sent.
    pub proxy_authorization: Option<String>,
    /// The whole request head, as received.
    pub head: String,
    /// The status the proxy answered.
    pub status: u16,
}

#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    routes: Mutex<HashMap<String, SocketAddr>>,
    /// The `Proxy-Authorization` value demanded, if any.
    auth: Mutex<Option<String>>,
    /// The status of the proxy's own answers (non-CONNECT requests).
    answer: Mutex<u16>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A running test proxy.
pub struct TestProxy {
    shared: Arc<Shared>,
    port: u16,
    tls: bool,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestProxy {
    /// A plain-TCP proxy on `netns`'s 127.0.0.1.
    pub fn start_in(netns: &Netns) -> TestProxy {
        TestProxy::start_on(netns, "127.0.0.1", None)
    }

    /// A proxy reached over TLS with `tls` (an `https://` proxy URL).
    pub fn start_tls_in(netns: &Netns, tls: Arc<rustls::ServerConfig>) -> TestProxy {
        TestProxy::start_on(netns, "127.0.0.1", Some(tls))
    }

    /// On `bind` (an address of `netns`, or `0.0.0.0`), over TLS when `tls` is given. Its own
    /// answers to plain requests also make it an HTTP(S) server (a readiness gate).
    pub fn start_on(
        netns: &Netns,
        bind: &str,
        tls: Option<Arc<rustls::ServerConfig>>,
    ) -> TestProxy {
        let bind = format!("{bind}:0");
        let shared = Arc::new(Shared::default());
        *lock(&shared.answer) = 200;
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = shared.clone();
        let is_tls = tls.is_some();
        let (port_tx, port_rx) = std::sync::mpsc::channel();
        let netns_path = netns.path().to_string();
        // The whole proxy runs on a thread inside the netns: its listener, and the
        // connections it opens for tunnels.
        let thread = std::thread::Builder::new()
            .name("test-proxy".into())
            .spawn(move || {
                let ns = std::fs::File::open(&netns_path).expect("open the netns");
                nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
                    .expect("enter the netns");
                let listener = std::net::TcpListener::bind(bind.as_str()).unwrap();
                listener.set_nonblocking(true).unwrap();
                let _ = port_tx.send(listener.local_addr().unwrap().port());
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(serve(listener, tls, server, stopped));
                rt.shutdown_timeout(Duration::from_secs(1));
            })
            .expect("spawn the proxy thread");
        let port = port_rx.recv().expect("the proxy's port");
        TestProxy {
            shared,
            port,
            tls: is_tls,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `http://127.0.0.1:<port>` (`https://` for a TLS proxy).
    pub fn url(&self) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// The URL with `user:password@`.
    pub fn url_with_user(&self, user: &str, password: &str) -> String {
        let scheme = if self.tls { "https" } else { "http" };
        format!("{scheme}://{user}:{password}@127.0.0.1:{}", self.port)
    }

    /// Tunnels for `authority` (`host:port`, as the client writes it) go to `to`.
    pub fn route(&self, authority: &str, to: SocketAddr) {
        lock(&self.shared.routes).insert(authority.to_string(), to);
    }

    /// From now on every request must carry `Proxy-Authorization: Basic <user:password>`;
    /// others are answered 407.
    pub fn require_auth(&self, user: &str, password: &str) {
        let basic =
            calico_cni::support::encoding::base64_std(format!("{user}:{password}").as_bytes());
        *lock(&self.shared.auth) = Some(format!("Basic {basic}"));
    }

    /// The status the proxy answers a non-CONNECT request with (200 until set).
    pub fn answer_with(&self, status: u16) {
        *lock(&self.shared.answer) = status;
    }

    /// Every request so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        lock(&self.shared.seen).clone()
    }

    pub fn clear(&self) {
        lock(&self.shared.seen).clear();
    }
}

impl Drop for TestProxy {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn serve(
    listener: std::net::TcpListener,
    tls: Option<Arc<rustls::ServerConfig>>,
    shared: Arc<Shared>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) {
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let tcp = tokio::select! {
            _ = &mut stop => return,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(_) => continue,
            },
        };
        let (acceptor, shared) = (acceptor.clone(), shared.clone());
        tokio::spawn(async move {
            match acceptor {
                None => handle(tcp, shared).await,
                Some(a) => {
                    if let Ok(stream) = a.accept(tcp).await {
                        handle(stream, shared).await
                    }
                }
            }
        });
    }
}

/// Reads one request head (up to the blank line, byte by byte: nothing of a tunnel is read).
async fn read_head<S: AsyncRead + Unpin>(s: &mut S) -> Option<String> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if s.read(&mut b).await.ok()? == 0 || head.len() > 64 * 1024 {
            return None;
        }
        head.push(b[0]);
    }
    Some(String::from_utf8_lossy(&head).into_owned())
}

async fn handle<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, shared: Arc<Shared>) {
    let Some(head) = read_head(&mut s).await else {
        return;
    };
    let mut words = head.split_whitespace();
    let method = words.next().unwrap_or_default().to_string();
    let target = words.next().unwrap_or_default().to_string();
    let proxy_authorization = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case("proxy-authorization")
            .then(|| v.trim().to_string())
    });
    let wanted = lock(&shared.auth).clone();
    let record = |status: u16| {
        lock(&shared.seen).push(Seen {
            method: method.clone(),
            target: target.clone(),
            proxy_authorization: proxy_authorization.clone(),
            head: head.clone(),
            status,
        })
    };
    if wanted.is_some() && wanted != proxy_authorization {
        record(407);
        let _ = s
            .write_all(b"HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm=\"test\"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .await;
        return;
    }
    if method != "CONNECT" {
        let status = *lock(&shared.answer);
        record(status);
        let _ = s
            .write_all(
                format!("HTTP/1.1 {status} Test\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await;
        return;
    }
    let to = lock(&shared.routes).get(&target).copied();
    let upstream = match to {
        Some(addr) => tokio::net::TcpStream::connect(addr).await,
        None => tokio::net::TcpStream::connect(target.as_str()).await,
    };
    let Ok(mut upstream) = upstream else {
        record(502);
        let _ = s
            .write_all(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            .await;
        return;
    };
    record(200);
    if s.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")
        .await
        .is_err()
    {
        return;
    }
    let _ = tokio::io::copy_bidirectional(&mut s, &mut upstream).await;
}

/// A CA and a certificate signed by it for `names` (DNS names or IPs): (CA PEM, server
/// config with ALPN `alpn`).
pub fn tls_server(names: &[&str], alpn: &[&[u8]]) -> (String, Arc<rustls::ServerConfig>) {
    let ca = super::test_ca::TestCa::new("proxy test CA");
    let cert = ca.server_cert(names[0], names);
    (ca.pem, cert.server_config(alpn))
}
