//! `readiness_gates` (plugin.go at v3.32.1): before ADD does any IPAM or netns work, each URL
//! must be a valid request URI (`invalid URL set for ReadinessGates:<u> Error:<e>`) and must
//! answer a GET with a status from 200 to 399, after following redirects as Go's client does
//! (301, 302, 303, 307 and 308 with a `Location`, at most 10). Each gate is probed every 5 s for up to 30 s, each
//! probe bounded by the interval, as upstream; unlike upstream the first probe goes out at
//! once instead of after one interval, so a ready gate costs no pod-start time.
//!
//! The HTTP client is deliberately small: one HTTP/1.1 GET per probe, `Connection: close`,
//! plain TCP for `http://` and rustls for `https://`, each redirect a new GET. As Go's `http.Client{}` upstream probes with, it goes through the
//! environment's proxy (`HTTPS_PROXY`/`HTTP_PROXY`/`NO_PROXY`, Go's rules: see
//! `crate::support::http_proxy`), and trusts Go's system roots on Linux (`crypto/x509`'s
//! `root_linux.go` and `root_unix.go`): the first of its bundle files that can be read
//! (`SSL_CERT_FILE` instead when set) and every file of its certificate directories
//! (`SSL_CERT_DIR`'s, `:`-separated, instead when set), loaded once per process.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{error, info};

use crate::error::{ReadinessGateError, Result};
use crate::support::http_proxy::{self, ProxyEnv, ProxyUrl};

const POLL_INTERVAL: Duration = Duration::from_secs(5);
const POLL_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest one gate can make ADD wait: its polling time, and a last probe's timeout.
pub const MAX_WAIT_PER_GATE: Duration = POLL_TIMEOUT.saturating_add(POLL_INTERVAL);
/// Go's bundle files on Linux (`certFiles`), in its order: the first that reads is used.
const CERT_FILES: &[&str] = &[
    "/etc/ssl/certs/ca-certificates.crt", // Debian/Ubuntu/Gentoo etc.
    "/etc/pki/tls/certs/ca-bundle.crt",   // Fedora/RHEL 6
    "/etc/ssl/ca-bundle.pem",             // OpenSUSE
    "/etc/pki/tls/cacert.pem",            // OpenELEC
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem", // CentOS/RHEL 7
    "/etc/ssl/cert.pem",                  // Alpine Linux
];
/// Go's certificate directories on Linux (`certDirectories`): every file in each is read.
const CERT_DIRECTORIES: &[&str] = &["/etc/ssl/certs", "/etc/pki/tls/certs"];

/// A request URI, split as a GET needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateUrl {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// Path and query, at least `/`.
    pub target: String,
}

impl GateUrl {
    /// A redirect's `Location` resolved against this URL, as Go's `URL.Parse` resolves a
    /// reference: absolute, scheme-relative (`//host/p`), an absolute path, a query, or a
    /// path relative to this one's folder; dot segments removed; the fragment dropped.
    pub fn join(&self, location: &str) -> std::result::Result<GateUrl, String> {
        let location = location.split('#').next().unwrap_or_default();
        let scheme = if self.https { "https" } else { "http" };
        let authority = http_proxy::join_host_port(&self.host, &self.port.to_string());
        let (path, _) = self.target.split_once('?').unwrap_or((&self.target, ""));
        let has_scheme = location
            .split_once(':')
            .is_some_and(|(s, _)| !s.is_empty() && !s.contains(['/', '?']));
        let absolute = if has_scheme {
            location.to_string()
        } else if location.starts_with("//") {
            format!("{scheme}:{location}")
        } else if location.starts_with('/') {
            format!("{scheme}://{authority}{}", remove_dot_segments(location))
        } else if location.is_empty() {
            format!("{scheme}://{authority}{}", self.target)
        } else if let Some(query) = location.strip_prefix('?') {
            format!("{scheme}://{authority}{path}?{query}")
        } else {
            let folder = &path[..path.rfind('/').map_or(0, |i| i + 1)];
            let joined = format!("{folder}{location}");
            format!("{scheme}://{authority}{}", remove_dot_segments(&joined))
        };
        parse(&absolute)
    }
}

/// RFC 3986's `remove_dot_segments` on a path with its query (Go's `resolvePath`).
fn remove_dot_segments(target: &str) -> String {
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    for (i, seg) in segments.iter().enumerate() {
        let last = i + 1 == segments.len();
        match *seg {
            "." if last => out.push(""),
            "." => {}
            ".." => {
                out.pop();
                if last {
                    out.push("");
                }
            }
            s => out.push(s),
        }
    }
    let mut resolved = format!("/{}", out.join("/"));
    if let Some(q) = query {
        resolved.push('?');
        resolved.push_str(q);
    }
    resolved
}

/// Go's `url.ParseRequestURI` acceptance (an absolute URI or an absolute path), then what
/// an HTTP GET needs: an `http`/`https` scheme and a host. Errors are Go's texts.
pub fn parse(raw: &str) -> std::result::Result<GateUrl, String> {
    let invalid = || format!("parse \"{raw}\": invalid URI for request");
    // Go's `getScheme`: a `:` before any other character is a missing scheme.
    let scheme_end = raw
        .bytes()
        .position(|c| !(c.is_ascii_alphanumeric() || b"+-.".contains(&c)));
    if scheme_end == Some(0) && raw.starts_with(':') {
        return Err(format!("parse \"{raw}\": missing protocol scheme"));
    }
    let Some((scheme, rest)) = raw.split_once("://") else {
        return Err(if raw.starts_with('/') {
            format!("Get \"{raw}\": unsupported protocol scheme \"\"")
        } else {
            invalid()
        });
    };
    let valid_scheme = scheme
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    if !valid_scheme || raw.contains(|c: char| c.is_ascii_control() || c == ' ') {
        return Err(invalid());
    }
    let https = match scheme.to_ascii_lowercase().as_str() {
        "http" => false,
        "https" => true,
        other => {
            return Err(format!(
                "Get \"{raw}\": unsupported protocol scheme \"{other}\""
            ))
        }
    };
    let (authority, target) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], rest[i..].to_string()),
        Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
        None => (rest, "/".to_string()),
    };
    let target = target.split('#').next().unwrap_or("/").to_string();
    let authority = authority.rsplit('@').next().unwrap_or(authority);
    let default_port = if https { 443 } else { 80 };
    let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
        let (h, after) = v6.split_once(']').ok_or_else(invalid)?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| invalid())?,
            None if after.is_empty() => default_port,
            None => return Err(invalid()),
        };
        (h.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => (h.to_string(), p.parse().map_err(|_| invalid())?),
            None => (authority.to_string(), default_port),
        }
    };
    if host.is_empty() {
        return Err(format!("Get \"{raw}\": http: no Host in request URL"));
    }
    Ok(GateUrl {
        https,
        host,
        port,
        target,
    })
}

/// Waits until every gate is ready, in order; the first that is not fails the ADD.
pub async fn wait_for_gates(gates: &[String]) -> Result<()> {
    let proxies = ProxyEnv::from_process();
    for gate in gates {
        let url = parse(gate).map_err(|reason| ReadinessGateError::InvalidUrl {
            gate: gate.clone(),
            reason,
        })?;
        let waiting = format!("waiting for readiness gate {gate}");
        crate::support::deadline::bound(&waiting, poll(gate, &url, &proxies)).await??;
    }
    Ok(())
}

async fn poll(raw: &str, url: &GateUrl, proxies: &ProxyEnv) -> Result<()> {
    let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
    loop {
        match tokio::time::timeout(POLL_INTERVAL, probe(url, proxies)).await {
            Ok(Ok(status)) if (200..400).contains(&status) => {
                info!(gate = raw, status, "readiness gate is ready");
                return Ok(());
            }
            Ok(Ok(status)) => error!(
                gate = raw,
                "Endpoint may not be ready:endpoint is not ready, response code returned:{status}"
            ),
            Ok(Err(e)) => error!(gate = raw, "Endpoint may not be ready:{e}"),
            Err(_) => error!(
                gate = raw,
                "Endpoint may not be ready:context deadline exceeded"
            ),
        }
        if tokio::time::Instant::now() + POLL_INTERVAL > deadline {
            return Err(ReadinessGateError::NotReady {
                gate: raw.to_string(),
                within: POLL_TIMEOUT,
            }
            .into());
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Go's `http.Client` limit (`defaultCheckRedirect`): the 10th redirect is not followed.
const MAX_REDIRECTS: usize = 10;

/// The gate's status code: its GET's, or the last one's after following redirects as Go's
/// `http.Client` does (a 301, 302, 303, 307 or 308 with a `Location`; any other answer,
/// including a 3xx without a `Location`, is the final one).
async fn probe(url: &GateUrl, proxies: &ProxyEnv) -> std::io::Result<u16> {
    let mut url = url.clone();
    let mut followed = 0;
    loop {
        let answer = request(&url, proxies).await?;
        let location = match answer.location {
            Some(l) if matches!(answer.status, 301 | 302 | 303 | 307 | 308) => l,
            _ => return Ok(answer.status),
        };
        if followed + 1 >= MAX_REDIRECTS {
            return Err(std::io::Error::other(format!(
                "Get \"{location}\": stopped after {MAX_REDIRECTS} redirects"
            )));
        }
        url = url.join(&location).map_err(std::io::Error::other)?;
        followed += 1;
    }
}

/// What a GET's answer says that the probe needs.
struct Answer {
    status: u16,
    location: Option<String>,
}

/// One GET, through the proxy Go would choose for it.
async fn request(url: &GateUrl, proxies: &ProxyEnv) -> std::io::Result<Answer> {
    let scheme = if url.https { "https" } else { "http" };
    let proxy = proxies
        .for_go(scheme, &url.host, &url.port.to_string())
        .map_err(std::io::Error::other)?;
    let Some(proxy) = proxy else {
        let tcp = TcpStream::connect((url.host.as_str(), url.port)).await?;
        return match url.https {
            true => get(tls_to(&url.host, tcp).await?, url, None).await,
            false => get(tcp, url, None).await,
        };
    };
    let proxy_tls = match proxy.is_https() {
        true => Some(tls_connector()?),
        false => None,
    };
    let mut io = http_proxy::connect(&proxy, proxy_tls.as_ref())
        .await
        .map_err(std::io::Error::other)?;
    if !url.https {
        return get(io, url, Some(&proxy)).await;
    }
    let target = http_proxy::join_host_port(&url.host, &url.port.to_string());
    http_proxy::tunnel(&mut io, &target, &proxy)
        .await
        .map_err(std::io::Error::other)?;
    get(tls_to(&url.host, io).await?, url, None).await
}

/// The gate's TLS over `io`, checked against Go's system roots.
async fn tls_to<S: AsyncRead + AsyncWrite + Unpin>(
    host: &str,
    io: S,
) -> std::io::Result<tokio_rustls::client::TlsStream<S>> {
    let name = rustls_pki_types::ServerName::try_from(host.to_string())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    tls_connector()?.connect(name, io).await
}

/// A TLS client trusting Go's system roots.
fn tls_connector() -> std::io::Result<tokio_rustls::TlsConnector> {
    let roots = system_roots().map_err(std::io::Error::other)?;
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Go's system roots, loaded once per process (as Go loads them once).
fn system_roots() -> std::result::Result<Arc<tokio_rustls::rustls::RootCertStore>, String> {
    static ROOTS: std::sync::OnceLock<
        std::result::Result<Arc<tokio_rustls::rustls::RootCertStore>, String>,
    > = std::sync::OnceLock::new();
    ROOTS
        .get_or_init(|| {
            load_roots(&|k| std::env::var(k).ok())
                .map(Arc::new)
                .map_err(|e| e.to_string())
        })
        .clone()
}

/// Go's `loadSystemRoots` on Linux: the first bundle file that reads (`SSL_CERT_FILE`
/// instead of the list when set), then every file of each directory (`SSL_CERT_DIR`'s,
/// `:`-separated, when set), leaving out symlinks to a name in the same directory. A file
/// that is missing is no error; any other failure to read is kept, and fails the load only
/// when no certificate was found at all.
fn load_roots(
    env: &dyn Fn(&str) -> Option<String>,
) -> std::io::Result<tokio_rustls::rustls::RootCertStore> {
    use std::io::ErrorKind::NotFound;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    let mut first_err: Option<std::io::Error> = None;
    let keep = |e: std::io::Error, first_err: &mut Option<std::io::Error>| {
        if first_err.is_none() && e.kind() != NotFound {
            *first_err = Some(e);
        }
    };
    let file_env = env("SSL_CERT_FILE").filter(|f| !f.is_empty());
    let files: Vec<&str> = match &file_env {
        Some(f) => vec![f.as_str()],
        None => CERT_FILES.to_vec(),
    };
    for file in files {
        match crate::support::input_file::read(std::path::Path::new(file)) {
            Ok(pem) => {
                add_pem(&mut roots, &pem);
                break;
            }
            Err(e) => keep(
                std::io::Error::new(
                    e.kind(),
                    crate::support::gocompat::path_error("open", file, &e),
                ),
                &mut first_err,
            ),
        }
    }
    let dir_env = env("SSL_CERT_DIR").filter(|d| !d.is_empty());
    let dirs: Vec<&str> = match &dir_env {
        Some(d) => d.split(':').collect(),
        None => CERT_DIRECTORIES.to_vec(),
    };
    for dir in dirs {
        let entries = match std::fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) => {
                let text = crate::support::gocompat::path_error("open", dir, &e);
                keep(std::io::Error::new(e.kind(), text), &mut first_err);
                continue;
            }
        };
        for entry in entries.flatten() {
            let path = std::path::Path::new(dir).join(entry.file_name());
            let same_dir_link = entry.file_type().is_ok_and(|t| t.is_symlink())
                && std::fs::read_link(&path)
                    .is_ok_and(|t| !t.as_os_str().as_encoded_bytes().contains(&b'/'));
            if same_dir_link {
                continue;
            }
            if let Ok(pem) = crate::support::input_file::read(&path) {
                add_pem(&mut roots, &pem);
            }
        }
    }
    match first_err {
        Some(e) if roots.is_empty() => Err(e),
        _ => Ok(roots),
    }
}

/// Go's `AppendCertsFromPEM`: every CERTIFICATE block that parses; the rest is skipped.
fn add_pem(roots: &mut tokio_rustls::rustls::RootCertStore, pem: &[u8]) {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(pem).filter_map(|c| c.ok());
    roots.add_parsable_certificates(certs);
}

/// The GET on `s`: to the gate itself, or (`proxy`) to the proxy for an `http://` gate, with
/// the whole URL in the request line and the proxy's credentials, as Go sends it.
async fn get<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    url: &GateUrl,
    proxy: Option<&ProxyUrl>,
) -> std::io::Result<Answer> {
    let authority = http_proxy::join_host_port(&url.host, &url.port.to_string());
    let (target, proxy_auth) = match proxy {
        None => (url.target.clone(), String::new()),
        Some(p) => (
            format!("http://{authority}{}", url.target),
            p.authorization()
                .map(|a| format!("Proxy-Authorization: {a}\r\n"))
                .unwrap_or_default(),
        ),
    };
    let req = format!(
        "GET {target} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: Go-http-client/1.1\r\nAccept: */*\r\n{proxy_auth}Connection: close\r\n\r\n",
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    // The status line and the headers are all we need.
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 64 * 1024 {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&buf);
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let status = line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .filter(|_| line.starts_with("HTTP/"))
        .ok_or_else(|| std::io::Error::other(format!("malformed HTTP response: {line:.60}")))?;
    let location = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("location"))
        .map(|(_, value)| value.trim().to_string())
        .filter(|v| !v.is_empty());
    Ok(Answer { status, location })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse("http://127.0.0.1:9099/readiness?x=1").unwrap(),
            GateUrl {
                https: false,
                host: "127.0.0.1".into(),
                port: 9099,
                target: "/readiness?x=1".into()
            }
        );
        let u = parse("https://[::1]/ready").unwrap();
        assert_eq!((u.https, u.host.as_str(), u.port), (true, "::1", 443));
        assert_eq!(parse("http://h?q").unwrap().target, "/?q");
        assert_eq!(
            parse("not a url").unwrap_err(),
            "parse \"not a url\": invalid URI for request"
        );
        assert_eq!(
            parse("localhost:9099").unwrap_err(),
            "parse \"localhost:9099\": invalid URI for request"
        );
        assert_eq!(
            parse("ftp://h/x").unwrap_err(),
            "Get \"ftp://h/x\": unsupported protocol scheme \"ftp\""
        );
        assert_eq!(
            parse("::bad").unwrap_err(),
            "parse \"::bad\": missing protocol scheme"
        );
    }

    #[test]
    fn redirects_resolve_as_go_resolves_them() {
        let base = parse("http://127.0.0.1:9099/a/b/ready?x=1").unwrap();
        let join = |l: &str| {
            let u = base.join(l).unwrap();
            (u.https, u.host, u.port, u.target)
        };
        let local = |t: &str| (false, "127.0.0.1".to_string(), 9099, t.to_string());
        assert_eq!(join("/ok"), local("/ok"));
        assert_eq!(join("ok?y"), local("/a/b/ok?y"));
        assert_eq!(join("../c/./d"), local("/a/c/d"));
        assert_eq!(join("?z=2"), local("/a/b/ready?z=2"));
        assert_eq!(join("../.."), local("/"));
        assert_eq!(
            join("https://[::1]:8443/r#f"),
            (true, "::1".to_string(), 8443, "/r".to_string())
        );
        assert_eq!(
            join("//other/x"),
            (false, "other".to_string(), 80, "/x".to_string())
        );
        assert_eq!(
            base.join("ftp://h/x").unwrap_err(),
            "Get \"ftp://h/x\": unsupported protocol scheme \"ftp\""
        );
    }

    /// A server answering each connection in turn with the next of `answers`.
    async fn serve(answers: Vec<String>) -> (u16, tokio::task::JoinHandle<Vec<String>>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let mut asked = Vec::new();
            for answer in answers {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut b = [0u8; 1024];
                let n = s.read(&mut b).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&b[..n]).into_owned();
                asked.push(req.lines().next().unwrap_or_default().to_string());
                let _ = s
                    .write_all(answer.replace("{port}", &port.to_string()).as_bytes())
                    .await;
            }
            asked
        });
        (port, server)
    }

    #[tokio::test]
    async fn redirects_are_followed_to_the_final_answer() {
        let (port, server) = serve(vec![
            "HTTP/1.1 302 Found\r\nlocation: /next\r\n\r\n".into(),
            "HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:{port}/last\r\n\r\n"
                .into(),
            "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n".into(),
            "HTTP/1.1 301 Moved Permanently\r\nContent-Length: 0\r\n\r\n".into(),
        ])
        .await;
        let url = parse(&format!("http://127.0.0.1:{port}/ready")).unwrap();
        let direct = ProxyEnv::default();
        assert_eq!(probe(&url, &direct).await.unwrap(), 503);
        // A 3xx without a Location is the answer (ready, as any status below 400).
        assert_eq!(probe(&url, &direct).await.unwrap(), 301);
        assert_eq!(
            server.await.unwrap(),
            [
                "GET /ready HTTP/1.1",
                "GET /next HTTP/1.1",
                "GET /last HTTP/1.1",
                "GET /ready HTTP/1.1"
            ]
        );
    }

    #[tokio::test]
    async fn the_tenth_redirect_is_not_followed() {
        let (port, server) = serve(vec![
            "HTTP/1.1 302 Found\r\nLocation: /again\r\n\r\n".into();
            10
        ])
        .await;
        let url = parse(&format!("http://127.0.0.1:{port}/ready")).unwrap();
        let err = probe(&url, &ProxyEnv::default()).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "Get \"/again\": stopped after 10 redirects"
        );
        assert_eq!(server.await.unwrap().len(), 10);
    }

    #[tokio::test]
    async fn probes_a_local_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            for status in ["200 OK", "503 Service Unavailable"] {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut b = [0u8; 1024];
                let _ = s.read(&mut b).await;
                let _ = s
                    .write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes())
                    .await;
            }
        });
        let url = parse(&format!("http://127.0.0.1:{port}/ready")).unwrap();
        let direct = ProxyEnv::default();
        assert_eq!(probe(&url, &direct).await.unwrap(), 200);
        assert_eq!(probe(&url, &direct).await.unwrap(), 503);
        server.await.unwrap();
    }

    #[tokio::test]
    async fn an_http_gate_through_a_proxy_is_asked_in_absolute_form() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut b = vec![0u8; 2048];
            let n = s.read(&mut b).await.unwrap();
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
            String::from_utf8_lossy(&b[..n]).into_owned()
        });
        let proxies = ProxyEnv::from_env(&|k| {
            (k == "HTTP_PROXY").then(|| format!("http://u:p@127.0.0.1:{port}"))
        });
        // Not loopback, so proxied: the proxy (this server) answers for it.
        let url = parse("http://gate.invalid:9099/ready?x=1").unwrap();
        assert_eq!(probe(&url, &proxies).await.unwrap(), 204);
        let req = server.await.unwrap();
        assert!(
            req.starts_with(
                "GET http://gate.invalid:9099/ready?x=1 HTTP/1.1\r\nHost: gate.invalid:9099\r\n"
            ),
            "{req}"
        );
        assert!(req.contains(&format!(
            "Proxy-Authorization: Basic {}\r\n",
            crate::support::encoding::base64_std(b"u:p")
        )));
    }

    #[test]
    fn system_roots_as_go_searches_them() {
        let dir = std::env::temp_dir().join(format!("go-roots-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let certs = dir.join("certs");
        std::fs::create_dir_all(&certs).unwrap();
        let pem = |cn: &str| {
            let mut p = rcgen::CertificateParams::new(vec![cn.to_string()]).unwrap();
            p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let key = rcgen::KeyPair::generate().unwrap();
            p.self_signed(&key).unwrap().pem()
        };
        let env = |file: Option<String>, dirs: Option<String>| {
            move |k: &str| match k {
                "SSL_CERT_FILE" => file.clone(),
                "SSL_CERT_DIR" => dirs.clone(),
                _ => None,
            }
        };
        let bundle = dir.join("bundle.pem");
        std::fs::write(&bundle, format!("{}{}", pem("a"), pem("b"))).unwrap();
        std::fs::write(certs.join("c.crt"), pem("c")).unwrap();
        std::fs::write(certs.join("notes.txt"), "not a certificate").unwrap();
        // A same-directory symlink (c_rehash's) is skipped; one elsewhere is read.
        std::os::unix::fs::symlink("c.crt", certs.join("1234abcd.0")).unwrap();
        std::os::unix::fs::symlink(&bundle, certs.join("bundle-link.pem")).unwrap();
        let d = certs.display().to_string();
        let f = bundle.display().to_string();
        assert_eq!(
            load_roots(&env(Some(f.clone()), Some("/nonexistent".into())))
                .unwrap()
                .len(),
            2
        );
        assert_eq!(
            load_roots(&env(Some("/nonexistent".into()), Some(d.clone())))
                .unwrap()
                .len(),
            3
        );
        assert_eq!(
            load_roots(&env(Some(f), Some(format!("{d}:/nonexistent"))))
                .unwrap()
                .len(),
            5
        );
        // Nothing found and nothing failed: an empty pool, no error.
        assert!(load_roots(&env(
            Some("/nonexistent".into()),
            Some("/nonexistent".into())
        ))
        .unwrap()
        .is_empty());
        // A failure other than a missing file fails the load only when nothing was found.
        let e = load_roots(&env(Some(d.clone()), Some("/nonexistent".into()))).unwrap_err();
        assert_eq!(e.to_string(), format!("open {d}: not a regular file"));
        assert_eq!(load_roots(&env(Some(d.clone()), Some(d))).unwrap().len(), 3);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
