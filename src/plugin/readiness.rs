//! `readiness_gates` (plugin.go at v3.32.1): before ADD does any IPAM or netns work, each URL
//! must be a valid request URI (`invalid URL set for ReadinessGates:<u> Error:<e>`) and must
//! answer a GET with a 2xx or 3xx status. Each gate is probed every 5 s for up to 30 s, each
//! probe bounded by the interval, as upstream; unlike upstream the first probe goes out at
//! once instead of after one interval, so a ready gate costs no pod-start time.
//!
//! The HTTP client is deliberately small: one HTTP/1.1 GET per probe, `Connection: close`,
//! plain TCP for `http://` and rustls (system CA bundle) for `https://`; a 3xx counts as
//! ready without following the redirect.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::{error, info};

use crate::error::{Error, Result};

const POLL_INTERVAL: Duration = Duration::from_secs(5);
const POLL_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest one gate can make ADD wait: its polling time, and a last probe's timeout.
pub const MAX_WAIT_PER_GATE: Duration = POLL_TIMEOUT.saturating_add(POLL_INTERVAL);
/// Where Debian (and most distributions) keep the system trust store as one PEM bundle.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// A request URI, split as a GET needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GateUrl {
    pub https: bool,
    pub host: String,
    pub port: u16,
    /// Path and query, at least `/`.
    pub target: String,
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
    for gate in gates {
        let url = parse(gate).map_err(|e| {
            Error::msg(format!(
                "invalid URL set for ReadinessGates:{gate} Error:{e}"
            ))
        })?;
        let waiting = format!("waiting for readiness gate {gate}");
        crate::deadline::bound(&waiting, poll(gate, &url)).await??;
    }
    Ok(())
}

async fn poll(raw: &str, url: &GateUrl) -> Result<()> {
    let deadline = tokio::time::Instant::now() + POLL_TIMEOUT;
    loop {
        match tokio::time::timeout(POLL_INTERVAL, probe(url)).await {
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
            return Err(Error::msg(format!(
                "readiness gate {raw} was not ready within {}s: context deadline exceeded",
                POLL_TIMEOUT.as_secs()
            )));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// One GET; the response's status code.
async fn probe(url: &GateUrl) -> std::io::Result<u16> {
    let tcp = TcpStream::connect((url.host.as_str(), url.port)).await?;
    if url.https {
        let tls = tls_connector()?;
        let name = rustls_pki_types::ServerName::try_from(url.host.clone())
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let stream = tls.connect(name, tcp).await?;
        get(stream, url).await
    } else {
        get(tcp, url).await
    }
}

fn tls_connector() -> std::io::Result<tokio_rustls::TlsConnector> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    let certs = rustls_pki_types::CertificateDer::pem_file_iter(CA_BUNDLE)
        .map_err(|e| std::io::Error::other(format!("{CA_BUNDLE}: {e}")))?;
    for cert in certs.flatten() {
        let _ = roots.add(cert);
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let config = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

async fn get<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, url: &GateUrl) -> std::io::Result<u16> {
    let host = if url.host.contains(':') {
        format!("[{}]", url.host)
    } else {
        url.host.clone()
    };
    let req = format!(
        "GET {} HTTP/1.1\r\nHost: {host}:{}\r\nUser-Agent: calico-cni\r\nAccept: */*\r\nConnection: close\r\n\r\n",
        url.target, url.port
    );
    s.write_all(req.as_bytes()).await?;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 512];
    // The status line is all we need.
    while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 4096 {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let line = String::from_utf8_lossy(&buf);
    line.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .filter(|_| line.starts_with("HTTP/"))
        .ok_or_else(|| std::io::Error::other(format!("malformed HTTP response: {line:.60}")))
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
        assert_eq!(probe(&url).await.unwrap(), 200);
        assert_eq!(probe(&url).await.unwrap(), 503);
        server.await.unwrap();
    }
}
