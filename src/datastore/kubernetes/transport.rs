//! The one connection a call makes to the API server. The first request opens it (TCP, then
//! TLS offering ALPN `h2` and `http/1.1`); every later request reuses it. Over HTTP/2,
//! requests issued together are multiplexed on it; over HTTP/1.1 (a server or proxy without
//! h2) they queue on it one at a time. Either way a call costs one TLS handshake, which
//! hyper's pooled client does not guarantee: requests started before the first connection is
//! up would each open their own. A connection the server has closed (an HTTP/2 GOAWAY: the
//! API server sends one after answering an unauthenticated request) is replaced by a new one
//! for the requests after it, as Go's transport does.
//!
//! Through an HTTP proxy (`Proxy`, chosen by the client as client-go chooses it, see
//! `crate::support::http_proxy`) the one connection is the proxy's: for an `https://` server a
//! `CONNECT` tunnel with the server's TLS (and HTTP/2, when offered) inside it, for an
//! `http://` server HTTP/1.1 with every request in absolute form and the proxy's
//! `Proxy-Authorization`, as Go's transport sends them.

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

use crate::support::http_proxy::{self, Io, ProxyUrl};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The HTTP proxy a connection goes through, and the TLS configuration for an `https://`
/// proxy URL (Go's transport reaches such a proxy with the client's own TLS settings).
pub struct Proxy {
    pub url: ProxyUrl,
    pub tls: Option<ClientConfig>,
}

/// Whether and how the connection goes through a proxy.
pub enum ProxyChoice {
    Direct,
    Via(Box<Proxy>),
    /// A proxy that cannot be used (Go's CGI refusal, a SOCKS proxy): every attempt to
    /// connect fails with this, as Go's requests fail with it.
    Refused(http_proxy::ProxyError),
}

/// How the connection reaches the server.
enum Route {
    Direct,
    Proxy {
        url: ProxyUrl,
        /// For an `https://` proxy URL.
        tls: Option<TlsConnector>,
        /// `Proxy-Authorization` of requests sent to the proxy itself (an `http://` server).
        auth: Option<http::HeaderValue>,
    },
    Refused(http_proxy::ProxyError),
}

enum Conn {
    H2(http2::SendRequest<Body>),
    H1(Mutex<http1::SendRequest<Body>>),
}

struct Inner {
    host: String,
    port: u16,
    /// None for a plain `http://` server.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    route: Route,
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
    /// overrides the name the certificate is checked against; `proxy` the HTTP proxy to go
    /// through, if any.
    pub fn new(
        server: &Uri,
        tls: Option<ClientConfig>,
        tls_name: Option<&str>,
        connect_timeout: Duration,
        proxy: ProxyChoice,
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
        let route = Route::new(proxy)?;
        Ok(OneConnection {
            inner: Arc::new(Inner {
                host,
                port,
                tls,
                route,
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

impl Route {
    fn new(proxy: ProxyChoice) -> Result<Route, BoxError> {
        let Proxy {
            url,
            tls: proxy_tls,
        } = match proxy {
            ProxyChoice::Direct => return Ok(Route::Direct),
            ProxyChoice::Refused(e) => return Ok(Route::Refused(e)),
            ProxyChoice::Via(p) => *p,
        };
        if let Err(e) = url.check_supported() {
            return Ok(Route::Refused(e));
        }
        let tls = match (url.is_https(), proxy_tls) {
            (false, _) => None,
            (true, None) => return Err("an https proxy needs a TLS configuration".into()),
            (true, Some(mut cfg)) => {
                // The CONNECT (or the forwarded requests) speak HTTP/1.1 to it.
                cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
                Some(TlsConnector::from(Arc::new(cfg)))
            }
        };
        let auth = match url.authorization() {
            None => None,
            Some(a) => {
                let mut v = http::HeaderValue::from_str(&a)?;
                v.set_sensitive(true);
                Some(v)
            }
        };
        tracing::debug!(proxy = %url, "the API server is reached through a proxy");
        Ok(Route::Proxy { url, tls, auth })
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
        let connect = async {
            match &self.route {
                Route::Refused(e) => Err(Box::new(e.duplicate()) as BoxError),
                Route::Direct => {
                    let tcp = TcpStream::connect((self.host.as_str(), self.port)).await?;
                    tcp.set_nodelay(true)?;
                    self.count_connection();
                    self.handshake(tcp).await
                }
                Route::Proxy { url, tls, .. } => {
                    let mut io = http_proxy::connect(url, tls.as_ref()).await?;
                    self.count_connection();
                    if self.tls.is_some() {
                        let target = http_proxy::join_host_port(&self.host, &self.port.to_string());
                        http_proxy::tunnel(&mut io, &target, url).await?;
                    }
                    self.handshake(io).await
                }
            }
        };
        // Never past the call's deadline (the request's own bound then reports it).
        let (until, _) = crate::support::deadline::cap_at(self.connect_timeout);
        tokio::time::timeout_at(until, connect)
            .await
            .map_err(|_| -> BoxError {
                let hop = match &self.route {
                    Route::Direct | Route::Refused(_) => {
                        format!("dial tcp {}:{}", self.host, self.port)
                    }
                    Route::Proxy { url, .. } => {
                        format!("proxyconnect tcp: dial tcp {}", url.addr())
                    }
                };
                format!(
                    "{hop}: i/o timeout (no connection within {:?})",
                    self.connect_timeout
                )
                .into()
            })?
    }

    fn count_connection(&self) {
        self.handshakes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The server's TLS (if any) and HTTP on a stream that reaches it.
    async fn handshake<T: Io>(&self, io: T) -> Result<Conn, BoxError> {
        let Some((connector, name)) = &self.tls else {
            return http1_conn(TokioIo::new(io)).await;
        };
        let stream = connector.connect(name.clone(), io).await?;
        let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(stream);
        if !h2 {
            return http1_conn(io).await;
        }
        let (send, conn) = http2::handshake(TokioExecutor::new(), io).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "API server connection ended");
            }
        });
        Ok(Conn::H2(send))
    }

    /// The requests of an `http://` server go to the proxy itself: `Proxy-Authorization` on
    /// each, as Go sets it.
    fn forwarding(&self) -> Option<Option<&http::HeaderValue>> {
        match (&self.route, &self.tls) {
            (Route::Proxy { auth, .. }, None) => Some(auth.as_ref()),
            _ => None,
        }
    }

    /// Takes `conn` out of use (when it is still the current one): the next request opens a
    /// new connection, as Go's transport stops reusing one that failed a request (a GOAWAY,
    /// a reset) even while it still drains.
    fn retire(&self, conn: &Arc<Conn>) {
        if let Ok(mut slot) = self.conn.lock() {
            if slot.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
                *slot = None;
            }
        }
    }

    async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, BoxError> {
        let conn = self.current().await?;
        let sent = self.send_on(&conn, req).await;
        if sent.is_err() {
            self.retire(&conn);
        }
        sent
    }

    async fn send_on(
        &self,
        conn: &Conn,
        mut req: Request<Body>,
    ) -> Result<Response<Incoming>, BoxError> {
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
                let req = match self.forwarding() {
                    Some(auth) => absolute_form(req, auth, &self.host, self.port)?,
                    None => origin_form(req)?,
                };
                let mut send = send.lock().await;
                send.ready().await?;
                Ok(send.send_request(req).await?)
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

/// A request to a proxy: the whole URL in the request line, the server's authority in
/// `Host`, and the proxy's credentials.
fn absolute_form(
    req: Request<Body>,
    auth: Option<&http::HeaderValue>,
    host: &str,
    port: u16,
) -> Result<Request<Body>, BoxError> {
    let (mut parts, body) = req.into_parts();
    let authority = match parts.uri.authority() {
        Some(a) => a.as_str().to_string(),
        None => http_proxy::join_host_port(host, &port.to_string()),
    };
    if parts.uri.scheme().is_none() || parts.uri.authority().is_none() {
        let path = parts
            .uri
            .path_and_query()
            .map(|p| p.as_str().to_string())
            .unwrap_or_else(|| "/".into());
        parts.uri = format!("http://{authority}{path}").parse()?;
    }
    parts
        .headers
        .insert(http::header::HOST, http::HeaderValue::from_str(&authority)?);
    if let Some(auth) = auth {
        parts
            .headers
            .insert(http::header::PROXY_AUTHORIZATION, auth.clone());
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt;

    fn get(uri: &str) -> Request<Body> {
        Request::get(uri).body(Body::empty()).unwrap()
    }

    #[tokio::test]
    async fn an_http_server_through_a_proxy_gets_absolute_form_requests_on_one_connection() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let proxy = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut heads = Vec::new();
            for _ in 0..2 {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    assert_eq!(s.read(&mut b).await.unwrap(), 1);
                    head.push(b[0]);
                }
                heads.push(String::from_utf8(head).unwrap());
                s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await
                    .unwrap();
            }
            heads
        });
        let url = ProxyUrl::from_env_value(&format!("http://u:p%40ss@127.0.0.1:{port}")).unwrap();
        let conn = OneConnection::new(
            &"http://kube.test:8080".parse().unwrap(),
            None,
            None,
            Duration::from_secs(5),
            ProxyChoice::Via(Box::new(Proxy { url, tls: None })),
        )
        .unwrap();
        for path in ["/api/v1/a", "/api/v1/b?x=1"] {
            let resp = conn
                .clone()
                .oneshot(get(&format!("http://kube.test:8080{path}")))
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
        }
        assert_eq!(conn.connections(), 1);
        let heads = proxy.await.unwrap();
        let auth = format!(
            "proxy-authorization: Basic {}\r\n",
            crate::support::encoding::base64_std(b"u:p@ss")
        );
        for (head, path) in heads.iter().zip(["/api/v1/a", "/api/v1/b?x=1"]) {
            assert!(
                head.starts_with(&format!("GET http://kube.test:8080{path} HTTP/1.1\r\n")),
                "{head}"
            );
            assert!(head.contains("host: kube.test:8080\r\n"), "{head}");
            assert!(head.contains(&auth), "{head}");
        }
    }

    #[tokio::test]
    async fn a_refused_proxy_fails_every_attempt_with_its_reason() {
        let conn = OneConnection::new(
            &"http://kube.test:8080".parse().unwrap(),
            None,
            None,
            Duration::from_secs(5),
            ProxyChoice::Refused(http_proxy::ProxyError::Cgi),
        )
        .unwrap();
        for _ in 0..2 {
            let e = conn
                .clone()
                .oneshot(get("http://kube.test:8080/api"))
                .await
                .unwrap_err();
            assert_eq!(
                e.to_string(),
                "refusing to use HTTP_PROXY value in CGI environment; see golang.org/s/cgihttpproxy"
            );
        }
        assert_eq!(conn.connections(), 0);
        // A SOCKS proxy is refused the same way.
        let socks = ProxyUrl::from_env_value("socks5://127.0.0.1:1080").unwrap();
        let conn = OneConnection::new(
            &"https://kube.test".parse().unwrap(),
            Some(test_tls()),
            None,
            Duration::from_secs(5),
            ProxyChoice::Via(Box::new(Proxy {
                url: socks,
                tls: None,
            })),
        )
        .unwrap();
        let e = conn
            .oneshot(get("https://kube.test/api"))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("proxy scheme \"socks5\" is not supported"),
            "{e}"
        );
    }

    fn test_tls() -> ClientConfig {
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(tokio_rustls::rustls::RootCertStore::empty())
            .with_no_client_auth()
    }
}
