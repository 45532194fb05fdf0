//! A thin REST client for the API server: kube's configuration loading (kubeconfig, token,
//! client certificates, CA data) and auth layer over `OneConnection`, with JSON bodies in
//! and out and every request bounded by a timeout and by the call's deadline
//! (`crate::deadline`: `min(timeout, what is left)`; nothing is sent once it has passed). The
//! bearer token is never logged.

use std::time::Duration;

use http::{Method, Request};
use http_body_util::BodyExt;
use kube::client::{Body, ConfigExt};
use serde::Deserialize;
use serde_json::Value;
use tower::ServiceBuilder;

use super::ratelimit::{RateLimit, RateLimiter, Refused};
use super::transport::OneConnection;
use crate::datastore::DatastoreError;

/// How to reach the API server: a kubeconfig file, and client-go's overrides on top of it.
/// Its `Debug` never shows the token.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KubeSettings {
    pub kubeconfig: String,
    /// Overrides the kubeconfig's server (`https://host:port`).
    pub server: String,
    pub token: String,
    pub ca_file: String,
    pub cert_file: String,
    pub key_file: String,
    pub insecure_skip_tls_verify: bool,
    pub context: String,
    /// The client-side rate limit (`ratelimit`); no limit by default.
    pub rate: RateLimit,
}

impl std::fmt::Debug for KubeSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeSettings")
            .field("kubeconfig", &self.kubeconfig)
            .field("server", &self.server)
            .field(
                "token",
                &if self.token.is_empty() {
                    ""
                } else {
                    "<redacted>"
                },
            )
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("insecure_skip_tls_verify", &self.insecure_skip_tls_verify)
            .field("context", &self.context)
            .field("rate", &self.rate)
            .finish()
    }
}

impl KubeSettings {
    /// Neither a kubeconfig nor a server: only an in-cluster configuration can serve.
    pub fn is_empty(&self) -> bool {
        self.kubeconfig.is_empty() && self.server.is_empty()
    }

    /// Whether `other` reaches the same API server the same way (the rate limit aside).
    pub fn same_server(&self, other: &KubeSettings) -> bool {
        let mut a = self.clone();
        a.rate = other.rate;
        a == *other
    }
}

/// client-go's text when nothing says where the API server is.
pub const NO_CONFIGURATION: &str =
    "invalid configuration: no configuration has been provided, try setting KUBERNETES_MASTER environment variable";

/// An answer from the API server.
#[derive(Debug)]
pub struct ApiResponse {
    pub status: u16,
    pub body: Vec<u8>,
}

/// The parts of a `metav1.Status` error body the client uses.
#[derive(Debug, Default, Deserialize)]
pub struct Status {
    #[serde(default)]
    pub message: String,
    #[serde(default)]
    pub reason: String,
    #[serde(default)]
    pub details: Option<StatusDetails>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StatusDetails {
    #[serde(default)]
    pub causes: Vec<StatusCause>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StatusCause {
    #[serde(default, rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub field: String,
}

impl ApiResponse {
    pub fn ok(&self) -> bool {
        (200..300).contains(&self.status)
    }

    pub fn json(&self) -> Result<Value, DatastoreError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| DatastoreError::Other(format!("invalid JSON from the API server: {e}")))
    }

    /// The error body as a Status, or one made of the raw text (`404 page not found`).
    pub fn status_object(&self) -> Status {
        serde_json::from_slice::<Status>(&self.body)
            .ok()
            .filter(|s| !s.message.is_empty() || !s.reason.is_empty())
            .unwrap_or_else(|| Status {
                message: String::from_utf8_lossy(&self.body).trim().to_string(),
                ..Default::default()
            })
    }
}

/// A connected (lazily: the first request connects) API client.
pub struct KubeClient {
    settings: KubeSettings,
    client: kube::Client,
    transport: OneConnection,
    timeout: Duration,
    limiter: RateLimiter,
}

fn config_error(e: impl std::fmt::Display) -> DatastoreError {
    DatastoreError::Config(e.to_string())
}

/// kube's configuration for these settings, with client-go's overrides applied.
async fn load_config(s: &KubeSettings) -> Result<kube::Config, DatastoreError> {
    let mut cfg = if !s.kubeconfig.is_empty() {
        // client-go's loading rules stat an explicit kubeconfig first, in Go's words.
        if let Err(e) = std::fs::metadata(&s.kubeconfig) {
            return Err(config_error(crate::gocompat::path_error(
                "stat",
                &s.kubeconfig,
                &e,
            )));
        }
        refuse_irregular(&s.kubeconfig)?;
        let file = kube::config::Kubeconfig::read_from(&s.kubeconfig).map_err(config_error)?;
        refuse_irregular_in(&file)?;
        let opts = kube::config::KubeConfigOptions {
            context: (!s.context.is_empty()).then(|| s.context.clone()),
            ..Default::default()
        };
        kube::Config::from_custom_kubeconfig(file, &opts)
            .await
            .map_err(config_error)?
    } else if !s.server.is_empty() {
        kube::Config::new(parse_server(&s.server)?)
    } else {
        kube::Config::incluster_env().map_err(|_| config_error(NO_CONFIGURATION))?
    };
    if !s.server.is_empty() {
        cfg.cluster_url = parse_server(&s.server)?;
    }
    if !s.ca_file.is_empty() {
        cfg.root_cert = Some(read_certs(&s.ca_file)?);
        cfg.root_cert_file = None;
    }
    if !s.token.is_empty() {
        cfg.auth_info.token = Some(secrecy::SecretString::from(s.token.clone()));
        cfg.auth_info.token_file = None;
    }
    if !s.cert_file.is_empty() {
        refuse_irregular(&s.cert_file)?;
        cfg.auth_info.client_certificate = Some(s.cert_file.clone());
        cfg.auth_info.client_certificate_data = None;
    }
    if !s.key_file.is_empty() {
        refuse_irregular(&s.key_file)?;
        cfg.auth_info.client_key = Some(s.key_file.clone());
        cfg.auth_info.client_key_data = None;
    }
    if s.insecure_skip_tls_verify {
        cfg.accept_invalid_certs = true;
    }
    Ok(cfg)
}

/// A server given as `host:port` or a URL; anything after `/api/` is dropped (old configs
/// named `https://host:6443/api/v1/`).
fn parse_server(server: &str) -> Result<http::Uri, DatastoreError> {
    let base = server.split("/api/").next().unwrap_or(server);
    let base = base.trim_end_matches('/');
    let with_scheme = if base.contains("://") {
        base.to_string()
    } else {
        format!("https://{base}")
    };
    with_scheme
        .parse()
        .map_err(|e| config_error(format!("invalid API server address {server:?}: {e}")))
}

/// A file kube opens itself (a FIFO there would block the call): refused here unless it is a
/// regular file (see `input_file`).
fn refuse_irregular(path: &str) -> Result<(), DatastoreError> {
    crate::input_file::refuse_irregular(std::path::Path::new(path))
        .map_err(|e| config_error(format!("{path}: {e}")))
}

/// The files a kubeconfig names, which kube opens when it builds the configuration.
fn refuse_irregular_in(file: &kube::config::Kubeconfig) -> Result<(), DatastoreError> {
    let clusters = file.clusters.iter().filter_map(|c| c.cluster.as_ref());
    let users = file.auth_infos.iter().filter_map(|u| u.auth_info.as_ref());
    clusters
        .filter_map(|c| c.certificate_authority.as_deref())
        .chain(users.flat_map(|u| {
            [&u.token_file, &u.client_certificate, &u.client_key]
                .into_iter()
                .filter_map(|p| p.as_deref())
        }))
        .try_for_each(refuse_irregular)
}

fn read_certs(path: &str) -> Result<Vec<Vec<u8>>, DatastoreError> {
    use rustls_pki_types::pem::PemObject;
    refuse_irregular(path)?;
    let certs: Result<Vec<_>, _> = rustls_pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| config_error(format!("unable to read certificate-authority {path}: {e}")))?
        .map(|c| c.map(|c| c.to_vec()))
        .collect();
    certs.map_err(|e| config_error(format!("unable to read certificate-authority {path}: {e}")))
}

impl KubeClient {
    /// Builds the client; nothing is sent until the first request.
    pub async fn new(s: &KubeSettings, timeout: Duration) -> Result<KubeClient, DatastoreError> {
        s.rate.check().map_err(config_error)?;
        let cfg = load_config(s).await?;
        let tls = if cfg.cluster_url.scheme_str() == Some("http") {
            None
        } else {
            Some(cfg.rustls_client_config().map_err(config_error)?)
        };
        let transport = OneConnection::new(
            &cfg.cluster_url,
            tls,
            cfg.tls_server_name.as_deref(),
            timeout,
        )
        .map_err(config_error)?;
        let service = ServiceBuilder::new()
            .layer(cfg.base_uri_layer())
            .option_layer(cfg.auth_layer().map_err(config_error)?)
            .service(transport.clone());
        Ok(KubeClient {
            settings: s.clone(),
            client: kube::Client::new(service, cfg.default_namespace.clone()),
            transport,
            timeout,
            limiter: RateLimiter::new(s.rate),
        })
    }

    /// This client's connection, as another client with its own rate limit: upstream's
    /// plugin reads pods through a client of its own, with client-go's default limit, where
    /// this one shares the datastore's connection.
    pub fn with_rate(&self, rate: RateLimit) -> Result<KubeClient, DatastoreError> {
        rate.check().map_err(config_error)?;
        Ok(KubeClient {
            settings: KubeSettings {
                rate,
                ..self.settings.clone()
            },
            client: self.client.clone(),
            transport: self.transport.clone(),
            timeout: self.timeout,
            limiter: RateLimiter::new(rate),
        })
    }

    /// The settings this client was built from.
    pub fn settings(&self) -> &KubeSettings {
        &self.settings
    }

    /// Opens the connection now, if it is not open yet (the first request would); a failure
    /// is left for the first request to meet and report.
    pub async fn open(&self) {
        self.transport.open().await
    }

    /// Starts opening the connection in the background (a task on the call's runtime), so
    /// that the first request finds it open or joins its opening. A failure is left for
    /// that request to meet and report (it tries again).
    pub fn open_soon(&self) {
        let transport = self.transport.clone();
        tokio::spawn(async move { transport.open().await });
    }

    /// Connections opened so far (at most one).
    pub fn connections(&self) -> usize {
        self.transport.connections()
    }

    /// One request; `body` is (content type, bytes). Transport failures and timeouts are
    /// `Unavailable`; any HTTP answer, error statuses included, is returned. An answer that
    /// asks to be tried again later (429, or a 5xx, with `Retry-After`: the API server's
    /// flow control, or a watch cache still initializing) is sent again after the wait it
    /// names, as client-go does, at most [`MAX_RETRIES`] times and never past the deadline.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        body: Option<(&str, Vec<u8>)>,
    ) -> Result<ApiResponse, DatastoreError> {
        let mut retries = 0;
        loop {
            let (resp, retry_after) = self.send_once(&method, path, body.as_ref()).await?;
            let wait = match retry_after {
                Some(wait) if retries < MAX_RETRIES => wait,
                _ => return Ok(resp),
            };
            if crate::deadline::remaining() <= wait {
                return Ok(resp);
            }
            retries += 1;
            tracing::debug!(%method, path, status = resp.status, ?wait, retries, "API server asked to retry");
            tokio::time::sleep(wait).await;
        }
    }

    /// One exchange: the answer, and the wait it asks for before a retry, if it asks for one.
    async fn send_once(
        &self,
        method: &Method,
        path: &str,
        body: Option<&(&str, Vec<u8>)>,
    ) -> Result<(ApiResponse, Option<Duration>), DatastoreError> {
        let request = || {
            let mut req = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(http::header::ACCEPT, "application/json");
            let body = match body {
                Some((content_type, bytes)) => {
                    req = req.header(http::header::CONTENT_TYPE, *content_type);
                    Body::from(bytes.clone())
                }
                None => Body::empty(),
            };
            req.body(body)
                .map_err(|e| DatastoreError::Other(e.to_string()))
        };
        let req = request()?;
        let exchange = async {
            // A request the server did not process because it closed the connection
            // (HTTP/2 GOAWAY or REFUSED_STREAM; the API server sends one after answering an
            // unauthenticated request on it) is sent again on a new connection, once, as
            // Go's HTTP/2 transport does.
            let resp = match self.client.send(req).await {
                Err(e) if unprocessed(&e) => {
                    tracing::debug!(%method, path, error = %e, "not processed by the API server (its connection closed): sent again");
                    self.client.send(request().map_err(|e| e.to_string())?).await
                }
                other => other,
            }
            .map_err(|e| e.to_string())?;
            let status = resp.status().as_u16();
            let retry_after = retry_after(status, resp.headers());
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes()
                .to_vec();
            Ok::<_, String>((ApiResponse { status, body }, retry_after))
        };
        let waiting = || format!("waiting for the Kubernetes API server ({method} {path})");
        crate::deadline::check(waiting())?;
        self.throttle(method, path).await?;
        let (until, capped) = crate::deadline::cap_at(self.timeout);
        let sent = std::time::Instant::now();
        match tokio::time::timeout_at(until, exchange).await {
            Ok(Ok(r)) => {
                tracing::debug!(%method, path, status = r.0.status, took = ?sent.elapsed(), "API request");
                Ok(r)
            }
            // The connection's own timeout is capped the same way: past the deadline, say so.
            Ok(Err(_)) | Err(_) if capped && crate::deadline::remaining().is_zero() => {
                Err(crate::deadline::expired(waiting()).into())
            }
            Ok(Err(e)) => Err(DatastoreError::Unavailable(format!("{method} {path}: {e}"))),
            Err(_) => Err(DatastoreError::Unavailable(format!(
                "{method} {path}: context deadline exceeded (no answer within {:?})",
                self.timeout
            ))),
        }
    }

    /// Waits for the request's token (`ratelimit`), before its own timeout starts, as
    /// client-go does; a wait that would end past the deadline is not begun.
    async fn throttle(&self, method: &Method, path: &str) -> Result<(), DatastoreError> {
        let wait = self
            .limiter
            .reserve(path, std::time::Instant::now(), crate::deadline::limit());
        match wait {
            Ok(wait) if wait.is_zero() => Ok(()),
            Ok(wait) => {
                tracing::debug!(%method, path, ?wait, "client-side throttling");
                tokio::time::sleep(wait).await;
                Ok(())
            }
            Err(Refused::PastDeadline) => Err(crate::deadline::expired(format!(
                "waiting for the client-side rate limit ({method} {path})"
            ))
            .into()),
            Err(e @ Refused::OverBurst(_)) => Err(DatastoreError::Other(e.to_string())),
        }
    }

    pub async fn get(&self, path: &str) -> Result<ApiResponse, DatastoreError> {
        self.request(Method::GET, path, None).await
    }

    pub async fn send_json(
        &self,
        method: Method,
        path: &str,
        content_type: &str,
        body: &Value,
    ) -> Result<ApiResponse, DatastoreError> {
        let bytes = serde_json::to_vec(body).map_err(|e| DatastoreError::Other(e.to_string()))?;
        self.request(method, path, Some((content_type, bytes)))
            .await
    }
}

/// Whether the server closed the connection without processing the request: an HTTP/2
/// GOAWAY, a stream it refused (`REFUSED_STREAM`), or a request hyper never sent because the
/// connection had closed (canceled). Such a request may be sent again.
fn unprocessed(e: &kube::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(h2) = c.downcast_ref::<h2::Error>() {
            return h2.is_go_away() || h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        if c.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_canceled)
        {
            return true;
        }
        cause = c.source();
    }
    false
}

/// How many times one request is sent again when the API server asks for it (client-go's
/// default `maxRetries`).
pub const MAX_RETRIES: u32 = 10;

/// The wait an answer asks for before the request is sent again: client-go's rule, a 429 or
/// a 5xx with a `Retry-After` of whole seconds (at least one).
pub fn retry_after(status: u16, headers: &http::HeaderMap) -> Option<Duration> {
    if status != 429 && !(500..=599).contains(&status) {
        return None;
    }
    let seconds: u64 = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(Duration::from_secs(seconds.max(1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_as_client_go_reads_it() {
        let mut h = http::HeaderMap::new();
        assert_eq!(retry_after(429, &h), None, "no header: not retried");
        h.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("1"),
        );
        assert_eq!(retry_after(429, &h), Some(Duration::from_secs(1)));
        assert_eq!(retry_after(503, &h), Some(Duration::from_secs(1)));
        assert_eq!(retry_after(409, &h), None, "not a retryable status");
        assert_eq!(retry_after(200, &h), None);
        h.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("0"),
        );
        assert_eq!(
            retry_after(429, &h),
            Some(Duration::from_secs(1)),
            "at least a second"
        );
        h.insert(
            http::header::RETRY_AFTER,
            http::HeaderValue::from_static("Wed, 21 Oct 2015 07:28:00 GMT"),
        );
        assert_eq!(retry_after(429, &h), None, "a date is not seconds");
    }

    #[test]
    fn debug_never_shows_the_token() {
        let s = KubeSettings {
            token: "s3cr3t".into(),
            ..Default::default()
        };
        assert!(!format!("{s:?}").contains("s3cr3t"));
    }

    #[test]
    fn server_addresses() {
        assert_eq!(
            parse_server("https://10.0.0.1:6443/api/v1/")
                .unwrap()
                .to_string(),
            "https://10.0.0.1:6443/"
        );
        assert_eq!(
            parse_server("10.0.0.1:6443").unwrap().to_string(),
            "https://10.0.0.1:6443/"
        );
    }

    #[test]
    fn status_bodies() {
        let r = ApiResponse {
            status: 404,
            body: br#"{"kind":"Status","message":"pods \"p\" not found","reason":"NotFound","code":404}"#.to_vec(),
        };
        assert_eq!(r.status_object().message, "pods \"p\" not found");
        let r = ApiResponse {
            status: 404,
            body: b"404 page not found\n".to_vec(),
        };
        assert_eq!(r.status_object().message, "404 page not found");
    }
}
