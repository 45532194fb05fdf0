//! A thin REST client for the API server: kube's configuration loading (kubeconfig, token,
//! client certificates, CA data) and auth layer over `OneConnection`, with JSON bodies in
//! and out and every request bounded by a timeout and by the call's deadline
//! (`crate::support::deadline`: `min(timeout, what is left)`; nothing is sent once it has passed). The
//! bearer token is never logged.
//!
//! The kubeconfig is read as client-go's loading rules read it: one explicit file, or (the
//! datastore's `KUBECONFIG` naming several, `a:b`) each file that exists merged into one,
//! the first file to name a cluster, user or context winning it whole and the first
//! non-empty `current-context` winning. The HTTP proxy is client-go's: the selected
//! cluster's `proxy-url` when it has one, else the environment's (`crate::support::http_proxy`).

use std::time::Duration;

use http::{Method, Request};
use http_body_util::BodyExt;
use kube::client::{Body, ConfigExt};
use serde::Deserialize;
use serde_json::Value;
use tower::ServiceBuilder;

use super::ratelimit::{RateLimit, RateLimiter, Refused};
use super::transport::{OneConnection, Proxy, ProxyChoice};
use crate::datastore::{ClientError, DatastoreError};
use crate::support::http_proxy::{ProxyEnv, ProxyUrl};

/// How to reach the API server: a kubeconfig file, and client-go's overrides on top of it.
/// Its `Debug` never shows the token.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct KubeSettings {
    pub kubeconfig: String,
    /// `kubeconfig` is a list of files to merge (`a:b`, Go's `filepath.SplitList`), as
    /// libcalico-go hands the datastore's `KUBECONFIG` of more than one entry to client-go;
    /// otherwise it is one explicit path, whatever it contains.
    pub kubeconfig_list: bool,
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
            .field("kubeconfig_list", &self.kubeconfig_list)
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
            .map_err(|e| DatastoreError::InvalidJson(std::sync::Arc::new(e)))
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

/// kube's configuration for these settings, with client-go's overrides applied, and the
/// selected cluster's `proxy-url` (empty when it has none).
async fn load_config(s: &KubeSettings) -> Result<(kube::Config, ClusterProxy), DatastoreError> {
    let (mut cfg, proxy_url) = match read_kubeconfig(s)? {
        Some(mut file) => {
            refuse_irregular_in(&file)?;
            let context = (!s.context.is_empty()).then(|| s.context.clone());
            let proxy_url = take_proxy_urls(&mut file, context.as_deref());
            let opts = kube::config::KubeConfigOptions {
                context,
                ..Default::default()
            };
            let cfg = kube::Config::from_custom_kubeconfig(file, &opts)
                .await
                .map_err(config_error)?;
            (cfg, proxy_url)
        }
        None if !s.server.is_empty() => (
            kube::Config::new(parse_server(&s.server)?),
            ClusterProxy::default(),
        ),
        None => (
            kube::Config::incluster_env().map_err(|_| config_error(NO_CONFIGURATION))?,
            ClusterProxy::default(),
        ),
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
    Ok((cfg, proxy_url))
}

/// The kubeconfig to build the configuration from, `None` when there is none or (as
/// client-go takes it) it is empty: then the server override or the in-cluster
/// configuration serves. One explicit file must exist (`stat`, in Go's words); of a list,
/// missing files are skipped, and any other failure to read one fails the whole (client-go's
/// `error loading config file "<f>": …`, several in brackets).
fn read_kubeconfig(s: &KubeSettings) -> Result<Option<kube::config::Kubeconfig>, DatastoreError> {
    use kube::config::Kubeconfig;
    if s.kubeconfig.is_empty() {
        return Ok(None);
    }
    if !s.kubeconfig_list {
        if let Err(e) = std::fs::metadata(&s.kubeconfig) {
            return Err(config_error(crate::support::gocompat::path_error(
                "stat",
                &s.kubeconfig,
                &e,
            )));
        }
        refuse_irregular(&s.kubeconfig)?;
        let file = Kubeconfig::read_from(&s.kubeconfig).map_err(config_error)?;
        return Ok(Some(file).filter(|f| !is_empty_kubeconfig(f)));
    }
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for path in kubeconfig_paths(&s.kubeconfig) {
        let failed =
            |e: &dyn std::fmt::Display| format!("error loading config file \"{path}\": {e}");
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Ok(m) if !m.is_file() && !m.is_dir() => {
                errors.push(failed(&crate::support::input_file::not_regular()));
                continue;
            }
            _ => {}
        }
        match Kubeconfig::read_from(path) {
            Ok(f) => files.push(f),
            Err(kube::config::KubeconfigError::ReadConfig(e, _))
                if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errors.push(failed(&e)),
        }
    }
    match errors.len() {
        0 => {}
        1 => return Err(config_error(errors.remove(0))),
        _ => return Err(config_error(format!("[{}]", errors.join(", ")))),
    }
    if files.is_empty() {
        tracing::debug!(kubeconfig = %s.kubeconfig, "none of the kubeconfig files exists");
    }
    Ok(Some(merge_kubeconfigs(files)).filter(|f| !is_empty_kubeconfig(f)))
}

/// The files of a `KUBECONFIG` list: Go's `filepath.SplitList`, empty entries dropped and
/// repeated ones kept once, in order (libcalico-go's `deduplicate`).
pub fn kubeconfig_paths(list: &str) -> Vec<&str> {
    let mut seen = std::collections::HashSet::new();
    list.split(':')
        .filter(|p| !p.is_empty() && seen.insert(*p))
        .collect()
}

/// Whether libcalico-go hands this `KUBECONFIG` to client-go as a list to merge (more than
/// one entry, empty ones counted, as `filepath.SplitList` counts them) rather than as one
/// explicit path.
pub fn is_kubeconfig_list(kubeconfig: &str) -> bool {
    kubeconfig.split(':').count() > 1
}

/// client-go's merge of the files of a list: for clusters, users and contexts the first file
/// to name one wins it whole; the first non-empty `current-context` wins.
fn merge_kubeconfigs(files: Vec<kube::config::Kubeconfig>) -> kube::config::Kubeconfig {
    fn add_new<T>(base: &mut Vec<T>, next: Vec<T>, name: impl Fn(&T) -> &String) {
        for item in next {
            if !base.iter().any(|b| name(b) == name(&item)) {
                base.push(item);
            }
        }
    }
    let mut merged = kube::config::Kubeconfig::default();
    for f in files {
        add_new(&mut merged.clusters, f.clusters, |c| &c.name);
        add_new(&mut merged.auth_infos, f.auth_infos, |u| &u.name);
        add_new(&mut merged.contexts, f.contexts, |c| &c.name);
        if merged.current_context.as_deref().unwrap_or("").is_empty() {
            merged.current_context = f.current_context;
        }
        merged.kind = merged.kind.or(f.kind);
        merged.api_version = merged.api_version.or(f.api_version);
    }
    merged
}

/// A kubeconfig that names nothing (client-go's empty config).
fn is_empty_kubeconfig(f: &kube::config::Kubeconfig) -> bool {
    f.clusters.is_empty()
        && f.auth_infos.is_empty()
        && f.contexts.is_empty()
        && f.current_context.as_deref().unwrap_or("").is_empty()
}

/// The cluster `context` (or the current context) selects: its name and `proxy-url`.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct ClusterProxy {
    cluster: String,
    proxy_url: String,
}

/// client-go's refusal of a cluster's `proxy-url` (its `validateClusterInfo`).
#[derive(Debug, thiserror::Error)]
#[error("invalid configuration: invalid 'proxy-url' {} for cluster {}: {source}", crate::support::gocompat::go_quote(.url), crate::support::gocompat::go_quote(.cluster))]
struct InvalidProxyUrl {
    url: String,
    cluster: String,
    #[source]
    source: crate::support::http_proxy::ProxyUrlError,
}

/// The `proxy-url` of the cluster `context` (or the current context) selects, taken out of
/// the file so that kube never chooses a proxy itself: a cluster without one would make it
/// read `HTTPS_PROXY` with rules of its own (and fail on a value that is no URI), so every
/// cluster is given a fixed valid one instead, which the client ignores.
fn take_proxy_urls(file: &mut kube::config::Kubeconfig, context: Option<&str>) -> ClusterProxy {
    const IGNORED: &str = "http://ignored.invalid";
    let context = context.or(file.current_context.as_deref());
    let cluster = file
        .contexts
        .iter()
        .find(|c| Some(c.name.as_str()) == context)
        .and_then(|c| c.context.as_ref())
        .map(|c| c.cluster.clone());
    let mut selected: Option<ClusterProxy> = None;
    for named in &mut file.clusters {
        if let Some(c) = named.cluster.as_mut() {
            let url = c.proxy_url.replace(IGNORED.to_string()).unwrap_or_default();
            if Some(&named.name) == cluster.as_ref() && selected.is_none() {
                selected = Some(ClusterProxy {
                    cluster: named.name.clone(),
                    proxy_url: url,
                });
            }
        }
    }
    selected.unwrap_or_default()
}

/// The proxy client-go's transport uses for `server`: the kubeconfig's `proxy-url` when
/// set (for every request, whatever `NO_PROXY` says; one client-go refuses fails the
/// client, with its text), else the environment's (`ProxyFromEnvironment` behind
/// apimachinery's CIDR check, whose refusal fails each request instead).
fn choose_proxy(
    server: &http::Uri,
    kubeconfig: &ClusterProxy,
    env: &ProxyEnv,
) -> Result<Result<Option<ProxyUrl>, crate::support::http_proxy::ProxyError>, DatastoreError> {
    if !kubeconfig.proxy_url.is_empty() {
        return ProxyUrl::from_kubeconfig(&kubeconfig.proxy_url)
            .map(|p| Ok(Some(p)))
            .map_err(|source| {
                config_error(InvalidProxyUrl {
                    url: kubeconfig.proxy_url.clone(),
                    cluster: kubeconfig.cluster.clone(),
                    source,
                })
            });
    }
    let scheme = server.scheme_str().unwrap_or("https");
    let host = server
        .host()
        .unwrap_or_default()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = server
        .port()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    Ok(env.for_client_go(scheme, host, &port))
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
    crate::support::input_file::refuse_irregular(std::path::Path::new(path))
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
        let (cfg, proxy_url) = load_config(s).await?;
        let tls = if cfg.cluster_url.scheme_str() == Some("http") {
            None
        } else {
            Some(cfg.rustls_client_config().map_err(config_error)?)
        };
        let proxy = match choose_proxy(&cfg.cluster_url, &proxy_url, &ProxyEnv::from_process())? {
            Ok(None) => ProxyChoice::Direct,
            Ok(Some(url)) => {
                let tls = match url.is_https() {
                    true => Some(cfg.rustls_client_config().map_err(config_error)?),
                    false => None,
                };
                ProxyChoice::Via(Box::new(Proxy { url, tls }))
            }
            Err(refused) => ProxyChoice::Refused(refused),
        };
        let transport = OneConnection::new(
            &cfg.cluster_url,
            tls,
            cfg.tls_server_name.as_deref(),
            timeout,
            proxy,
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

    /// One request; `body` is (content type, bytes). Transport failures are `Request`,
    /// timeouts `Unavailable`; any HTTP answer, error statuses included, is returned. An
    /// answer that asks to be tried again later (429, or a 5xx, with `Retry-After`: the API
    /// server's flow control, or a watch cache still initializing) is sent again after the
    /// wait it names, as client-go does, at most [`MAX_RETRIES`] times and never past the
    /// deadline.
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
            if crate::support::deadline::remaining() <= wait {
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
            req.body(body).map_err(ClientError::new)
        };
        let req = request().map_err(DatastoreError::InvalidRequest)?;
        let exchange = async {
            // A request the server did not process because it closed the connection
            // (HTTP/2 GOAWAY or REFUSED_STREAM; the API server sends one after answering an
            // unauthenticated request on it, so of several requests in flight one is answered
            // per connection) is sent again on a new connection, at most 6 times as Go's
            // HTTP/2 transport does; at once each time (Go backs off after the first), as
            // each goes to a connection of its own and the call's deadline bounds them all.
            let mut req = Some(req);
            let mut resent: u32 = 0;
            let resp = loop {
                let this = match req.take() {
                    Some(r) => r,
                    None => request()?,
                };
                match self.client.send(this).await {
                    Err(e) if unprocessed(&e) && resent < MAX_RESENDS => {
                        tracing::debug!(%method, path, error = %e, resent, "not processed by the API server (its connection closed): sent again");
                        resent += 1;
                    }
                    other => break other,
                }
            }
            .map_err(ClientError::new)?;
            let status = resp.status().as_u16();
            let retry_after = retry_after(status, resp.headers());
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(ClientError::new)?
                .to_bytes()
                .to_vec();
            Ok::<_, ClientError>((ApiResponse { status, body }, retry_after))
        };
        let waiting = || format!("waiting for the Kubernetes API server ({method} {path})");
        crate::support::deadline::check(waiting())?;
        self.throttle(method, path).await?;
        let (until, capped) = crate::support::deadline::cap_at(self.timeout);
        let sent = std::time::Instant::now();
        match tokio::time::timeout_at(until, exchange).await {
            Ok(Ok(r)) => {
                tracing::debug!(%method, path, status = r.0.status, took = ?sent.elapsed(), "API request");
                Ok(r)
            }
            // The connection's own timeout is capped the same way: past the deadline, say so.
            Ok(Err(_)) | Err(_) if capped && crate::support::deadline::remaining().is_zero() => {
                Err(crate::support::deadline::expired(waiting()).into())
            }
            Ok(Err(source)) => Err(DatastoreError::Request {
                request: format!("{method} {path}"),
                source,
            }),
            Err(_) => Err(DatastoreError::Unavailable(format!(
                "{method} {path}: context deadline exceeded (no answer within {:?})",
                self.timeout
            ))),
        }
    }

    /// Waits for the request's token (`ratelimit`), before its own timeout starts, as
    /// client-go does; a wait that would end past the deadline is not begun.
    async fn throttle(&self, method: &Method, path: &str) -> Result<(), DatastoreError> {
        let wait = self.limiter.reserve(
            path,
            std::time::Instant::now(),
            crate::support::deadline::limit(),
        );
        match wait {
            Ok(wait) if wait.is_zero() => Ok(()),
            Ok(wait) => {
                tracing::debug!(%method, path, ?wait, "client-side throttling");
                tokio::time::sleep(wait).await;
                Ok(())
            }
            Err(Refused::PastDeadline) => Err(crate::support::deadline::expired(format!(
                "waiting for the client-side rate limit ({method} {path})"
            ))
            .into()),
            Err(e @ Refused::OverBurst(_)) => Err(DatastoreError::Throttled(e)),
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
        let bytes = serde_json::to_vec(body).map_err(DatastoreError::encode)?;
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

/// How many times a request the server closed its connection on unprocessed is sent again
/// (Go's HTTP/2 transport's limit).
const MAX_RESENDS: u32 = 6;

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

    fn kubeconfig(cluster: &str, server: &str, user: &str, token: &str, current: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: {cluster}\n  cluster:\n    server: {server}\n    insecure-skip-tls-verify: true\nusers:\n- name: {user}\n  user:\n    token: {token}\ncontexts:\n- name: {cluster}\n  context:\n    cluster: {cluster}\n    user: {user}\ncurrent-context: \"{current}\"\n"
        )
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kubeconfig-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn listed(paths: &[&std::path::Path]) -> KubeSettings {
        let kubeconfig = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        KubeSettings {
            kubeconfig_list: is_kubeconfig_list(&kubeconfig),
            kubeconfig,
            ..Default::default()
        }
    }

    fn token_of(cfg: &kube::Config) -> Option<String> {
        cfg.auth_info
            .token
            .as_ref()
            .map(|t| secrecy::ExposeSecret::expose_secret(t).to_string())
    }

    #[test]
    fn kubeconfig_lists_split_as_go_splits_them() {
        assert_eq!(kubeconfig_paths("/a:/b::/a:/c"), vec!["/a", "/b", "/c"]);
        assert!(kubeconfig_paths("").is_empty());
        assert!(is_kubeconfig_list("/a:"));
        assert!(!is_kubeconfig_list("/a"));
        assert!(!is_kubeconfig_list(""));
    }

    #[tokio::test]
    async fn a_kubeconfig_list_is_merged_first_file_wins() {
        let dir = scratch("merge");
        let (a, b) = (dir.join("a"), dir.join("b"));
        // Both name cluster `c`: the first file's wins whole; `b` adds user `u2` and context
        // `d`; the first non-empty current-context wins (`a`'s is empty).
        std::fs::write(&a, kubeconfig("c", "https://10.0.0.1:6443", "u1", "t1", "")).unwrap();
        std::fs::write(
            &b,
            kubeconfig("c", "https://10.0.0.2:6443", "u2", "t2", "c").replace(
                "current-context:",
                "- name: d\n  context:\n    cluster: c\n    user: u2\ncurrent-context:",
            ),
        )
        .unwrap();
        let missing = dir.join("missing");
        let s = listed(&[&missing, &a, &b]);
        let (cfg, proxy) = load_config(&s).await.unwrap();
        assert_eq!(cfg.cluster_url.to_string(), "https://10.0.0.1:6443/");
        // Context `c` of the first file uses `u1`.
        assert_eq!(token_of(&cfg).as_deref(), Some("t1"));
        assert_eq!(proxy.proxy_url, "");
        // A context override picks the second file's context, and its user.
        let s = KubeSettings {
            context: "d".into(),
            ..listed(&[&a, &b])
        };
        let (cfg, _) = load_config(&s).await.unwrap();
        assert_eq!(token_of(&cfg).as_deref(), Some("t2"));
        // No current context anywhere but a server override: client-go's empty-context path
        // is not this one; with every file missing, the override serves alone.
        let s = KubeSettings {
            server: "https://10.9.9.9:6443".into(),
            ..listed(&[&missing, &dir.join("missing2")])
        };
        let (cfg, _) = load_config(&s).await.unwrap();
        assert_eq!(cfg.cluster_url.to_string(), "https://10.9.9.9:6443/");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn a_kubeconfig_list_fails_on_a_file_that_is_not_a_kubeconfig() {
        let dir = scratch("bad");
        let (a, bad) = (dir.join("a"), dir.join("bad"));
        std::fs::write(
            &a,
            kubeconfig("c", "https://10.0.0.1:6443", "u1", "t1", "c"),
        )
        .unwrap();
        std::fs::write(&bad, "clusters: 7\n").unwrap();
        let e = load_config(&listed(&[&a, &bad]))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "error loading config file \"{}\": ",
                bad.display()
            )),
            "{e}"
        );
        let e = load_config(&listed(&[&bad, &dir]))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with('[') && e.contains(&bad.display().to_string()),
            "{e}"
        );
        // As one explicit path, the list is a file name that does not exist.
        let joined = format!("{}:{}", a.display(), bad.display());
        let s = KubeSettings {
            kubeconfig: joined.clone(),
            ..Default::default()
        };
        assert_eq!(
            load_config(&s).await.unwrap_err().to_string(),
            format!("stat {joined}: no such file or directory")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn the_selected_clusters_proxy_url_is_kept_and_kube_chooses_none() {
        let dir = scratch("proxy");
        let kc = dir.join("kc");
        let text = kubeconfig("c", "https://10.0.0.1:6443", "u", "t", "c").replace(
            "    insecure-skip-tls-verify: true\n",
            "    insecure-skip-tls-verify: true\n    proxy-url: http://user:pw@proxy:3128\n",
        );
        std::fs::write(&kc, text).unwrap();
        let s = KubeSettings {
            kubeconfig: kc.display().to_string(),
            ..Default::default()
        };
        let (cfg, proxy) = load_config(&s).await.unwrap();
        assert_eq!(
            proxy,
            ClusterProxy {
                cluster: "c".into(),
                proxy_url: "http://user:pw@proxy:3128".into()
            }
        );
        let env = ProxyEnv::from_env(&|k| (k == "NO_PROXY").then(|| "*".to_string()));
        let chosen = choose_proxy(&cfg.cluster_url, &proxy, &env)
            .unwrap()
            .unwrap();
        assert_eq!(
            chosen.map(|p| p.to_string()).as_deref(),
            Some("http://proxy:3128")
        );
        let ftp = ClusterProxy {
            cluster: "c".into(),
            proxy_url: "ftp://p".into(),
        };
        assert_eq!(
            choose_proxy(&cfg.cluster_url, &ftp, &env)
                .unwrap_err()
                .to_string(),
            "invalid configuration: invalid 'proxy-url' \"ftp://p\" for cluster \"c\": unsupported scheme \"ftp\", must be http, https, or socks5"
        );
        // Without one: the environment's, with NO_PROXY.
        let env = ProxyEnv::from_env(&|k| match k {
            "HTTPS_PROXY" => Some("proxy:3128".into()),
            "NO_PROXY" => Some("10.0.0.2".into()),
            _ => None,
        });
        let uri = |u: &str| u.parse::<http::Uri>().unwrap();
        let via = |u: &str| {
            choose_proxy(&uri(u), &ClusterProxy::default(), &env)
                .unwrap()
                .unwrap()
                .map(|p| p.to_string())
        };
        assert_eq!(
            via("https://10.0.0.1:6443").as_deref(),
            Some("http://proxy:3128")
        );
        assert_eq!(via("https://10.0.0.2:6443"), None);
        assert_eq!(via("https://[::1]:6443"), None);
        assert_eq!(via("http://10.0.0.1:8080"), None, "HTTP_PROXY is not set");
        std::fs::remove_dir_all(&dir).unwrap();
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
