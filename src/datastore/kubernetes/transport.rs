//! The one connection a call makes to the API server. The first request opens it (TCP, then
//! TLS offering ALPN `h2` and `http/1.1`); every later request reuses it. Over HTTP/2,
//! requests issued together are multiplexed on it; over HTTP/1.1 (a server or proxy without
//! h2) they queue on it one at a time. Either way a call costs one TLS handshake, which
//! hyper's pooled client does not guarantee: requests started before the first connection is
//! up would each open their own. A connection the server has closed (an HTTP/2 GOAWAY: the
//! API server sends one after answering an unauthenticated request) is replaced by a new one
//! for the requests after it, as Go's transport does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls_pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::Mutex;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::TlsConnector;

use kube::client::Body;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

enum Conn {
    H2(http2::SendRequest<Body>),
    H1(Mutex<http1::SendRequest<Body>>),
}

struct Inner {
    host: String,
    port: u16,
    /// None for a plain `http://` server.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    connect_timeout: Duration,
    /// The connection, once opened (replaced once the server has closed it).
    conn: std::sync::Mutex<Option<Arc<Conn>>>,
    /// Held while a connection is being opened: requests started meanwhile wait for it.
    opening: Mutex<()>,
    handshakes: std::sync::atomic::AtomicUsize,
}

/// A tower service sending every request over one lazily opened connection.
#[derive(Clone)]
pub struct OneConnection {
    inner: Arc<Inner>,
}

impl OneConnection {
    /// `server` is the cluster URL; `tls` the client config (ALPN is set here); `tls_name`
    /// overrides the name the certificate is checked against.
    pub fn new(
        server: &Uri,
        tls: Option<ClientConfig>,
        tls_name: Option<&str>,
        connect_timeout: Duration,
    ) -> Result<OneConnection, BoxError> {
        let host = server
            .host()
            .ok_or_else(|| format!("no host in the API server URL {server}"))?
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_string();
        let https = server.scheme_str() != Some("http");
        let port = server.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = match (https, tls) {
            (false, _) => None,
            (true, None) => return Err("an https API server needs a TLS configuration".into()),
            (true, Some(mut cfg)) => {
                cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
                let name = ServerName::try_from(tls_name.unwrap_or(&host).to_string())
                    .map_err(|e| format!("invalid TLS server name: {e}"))?;
                Some((TlsConnector::from(Arc::new(cfg)), name))
            }
        };
        Ok(OneConnection {
            inner: Arc::new(Inner {
                host,
                port,
                tls,
                connect_timeout,
                conn: std::sync::Mutex::new(None),
                opening: Mutex::new(()),
                handshakes: Default::default(),
            }),
        })
    }

    /// Opens the connection now, if it is not open yet (the first request would); its
    /// failure is only logged.
    pub async fn open(&self) {
        let inner = &self.inner;
        if let Err(e) = inner.current().await {
            tracing::debug!(error = %e, "could not open the API server connection early");
        }
    }

    /// How many connections were opened (0 or 1).
    pub fn connections(&self) -> usize {
        self.inner
            .handshakes
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Conn {
    fn is_closed(&self) -> bool {
        match self {
            Conn::H2(s) => s.is_closed(),
            Conn::H1(s) => s.try_lock().is_ok_and(|s| s.is_closed()),
        }
    }
}

impl Inner {
    /// The open connection, or a new one when there is none or the server closed it.
    async fn current(&self) -> Result<Arc<Conn>, BoxError> {
        let open = || {
            self.conn
                .lock()
                .ok()
                .and_then(|c| c.clone())
                .filter(|c| !c.is_closed())
        };
        if let Some(c) = open() {
            return Ok(c);
        }
        let _opening = self.opening.lock().await;
        if let Some(c) = open() {
            return Ok(c);
        }
        let c = Arc::new(self.open().await?);
        if let Ok(mut slot) = self.conn.lock() {
            *slot = Some(c.clone());
        }
        Ok(c)
    }

    async fn open(&self) -> Result<Conn, BoxError> {
        let addr = (self.host.as_str(), self.port);
        let connect = async {
            let tcp = TcpStream::connect(addr).await?;
            tcp.set_nodelay(true)?;
            self.handshakes
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match &self.tls {
                None => http1_conn(TokioIo::new(tcp)).await,
                Some((connector, name)) => {
                    let stream = connector.connect(name.clone(), tcp).await?;
                    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                    let io = TokioIo::new(stream);
                    if h2 {
                        let (send, conn) = http2::handshake(TokioExecutor::new(), io).await?;
                        tokio::spawn(async move {
                            if let Err(e) = conn.await {
                                tracing::debug!(error = %e, "API server connection ended");
                            }
                        });
                        Ok(Conn::H2(send))
                    } else {
                        http1_conn(io).await
                    }
                }
            }
        };
        // Never past the call's deadline (the request's own bound then reports it).
        let (until, _) = crate::deadline::cap_at(self.connect_timeout);
        tokio::time::timeout_at(until, connect)
            .await
            .map_err(|_| -> BoxError {
                format!(
                    "dial tcp {}:{}: i/o timeout (no connection within {:?})",
                    self.host, self.port, self.connect_timeout
                )
                .into()
            })?
    }

    async fn send(&self, mut req: Request<Body>) -> Result<Response<Incoming>, BoxError> {
        let conn = self.current().await?;
        let conn = conn.as_ref();
        if !req.headers().contains_key(http::header::USER_AGENT) {
            let agent = user_agent(req.uri().path(), matches!(conn, Conn::H2(_)));
            req.headers_mut().insert(
                http::header::USER_AGENT,
                http::HeaderValue::from_str(&agent)?,
            );
        }
        match conn {
            Conn::H2(send) => {
                let mut send = send.clone();
                send.ready().await?;
                Ok(send.send_request(req).await?)
            }
            Conn::H1(send) => {
                let mut send = send.lock().await;
                send.ready().await?;
                Ok(send.send_request(origin_form(req)?).await?)
            }
        }
    }
}

/// The User-Agent upstream's clients send, which the API server also records as the
/// manager of what they write (`metadata.managedFields`): libcalico-go reaches Calico's
/// resources through a REST client without one of its own, so Go's HTTP client names
/// itself; the core resources (pods, nodes, namespaces) go through client-go's clientset,
/// which names the program, as `<program>/v0.0.0 (linux/<arch>) kubernetes/$Format`.
fn user_agent(path: &str, h2: bool) -> String {
    let calico = path.starts_with("/apis/crd.projectcalico.org/")
        || path.starts_with("/apis/projectcalico.org/");
    if calico {
        return format!("Go-http-client/{}", if h2 { "2.0" } else { "1.1" });
    }
    let program = std::env::args_os()
        .next()
        .and_then(|a| {
            std::path::Path::new(&a)
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
        })
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "unknown".into());
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        "powerpc64" => "ppc64le",
        other => other,
    };
    format!("{program}/v0.0.0 (linux/{arch}) kubernetes/$Format")
}

async fn http1_conn<T>(io: TokioIo<T>) -> Result<Conn, BoxError>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (send, conn) = http1::handshake(io).await?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "API server connection ended");
        }
    });
    Ok(Conn::H1(Mutex::new(send)))
}

/// HTTP/1.1 requests carry the path in the request line and the authority in `Host`.
fn origin_form(req: Request<Body>) -> Result<Request<Body>, BoxError> {
    let (mut parts, body) = req.into_parts();
    if let Some(authority) = parts.uri.authority().cloned() {
        parts.headers.insert(
            http::header::HOST,
            http::HeaderValue::from_str(authority.as_str())?,
        );
    }
    let path = parts
        .uri
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "/".into());
    parts.uri = path.parse()?;
    Ok(Request::from_parts(parts, body))
}

impl tower::Service<Request<Body>> for OneConnection {
    type Response = Response<Incoming>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let inner = self.inner.clone();
        Box::pin(async move { inner.send(req).await })
    }
}
