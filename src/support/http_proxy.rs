//! HTTP proxies as upstream's Go clients choose and use them.
//!
//! * Which proxy: Go's `http.ProxyFromEnvironment` (`golang.org/x/net/http/httpproxy`, as
//!   vendored in Go 1.26): `HTTPS_PROXY` for `https://` URLs and `HTTP_PROXY` for `http://`
//!   ones, each also read in lower case (the upper-case name first; an empty value counts as
//!   unset), a value without a scheme taken as `http://`, one that does not parse ignored.
//!   `NO_PROXY` (or `no_proxy`) excludes hosts: `*` everything; an IP, optionally with a port
//!   (`10.0.0.1`, `10.0.0.1:6443`, `[fd00::1]:6443`); a CIDR (`10.0.0.0/8`); a domain, which
//!   matches itself and its subdomains (`example.com`), or only its subdomains with a leading
//!   `.` or `*.`, optionally with a port. Requests to `localhost` and to loopback addresses
//!   never go through a proxy. With `REQUEST_METHOD` set (a CGI environment) `HTTP_PROXY` is
//!   refused, with Go's error. [`ProxyEnv::for_go`] is this rule (the readiness gates' Go
//!   `http.Client{}`); [`ProxyEnv::for_client_go`] adds client-go's own CIDR check in front of
//!   it (apimachinery `NewProxierWithNoProxyCIDR`, which also takes IPv4 octets with leading
//!   zeros), the API client's rule when the kubeconfig names no `proxy-url`.
//! * How: an `https://` target through a `CONNECT` tunnel ([`tunnel`]), an `http://` one by
//!   sending the request itself to the proxy in absolute form; `Proxy-Authorization: Basic`
//!   from the proxy URL's user and password, as Go sends it. The proxy itself is reached over
//!   TCP, or TLS for an `https://` proxy URL ([`connect`]). SOCKS5 proxies (Go's `socks5://`,
//!   `socks5h://`) are not supported: a request for which one is chosen fails.
//!
//! A proxy URL's password is never shown: `Display` and `Debug` print `scheme://host:port`.

use std::net::{IpAddr, Ipv4Addr};
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::support::gocompat::io_error_text;
use crate::support::net::IpNet;

/// A byte stream a connection runs on: TCP, TLS over TCP, or either through a tunnel.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A boxed [`Io`].
pub struct BoxIo(Box<dyn Io>);

impl BoxIo {
    pub fn new(io: impl Io) -> BoxIo {
        BoxIo(Box::new(io))
    }
}

impl AsyncRead for BoxIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for BoxIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

/// Why a proxied connection could not be made, in Go's words where Go has them.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// `HTTP_PROXY` chosen while `REQUEST_METHOD` is set (Go's `httpproxy`).
    #[error("refusing to use HTTP_PROXY value in CGI environment; see golang.org/s/cgihttpproxy")]
    Cgi,
    /// A scheme Go would use and this client does not (`socks5`), or one Go would not either.
    #[error("proxy {proxy}: proxy scheme {scheme:?} is not supported")]
    UnsupportedScheme { proxy: String, scheme: String },
    /// A port Go's dialer would refuse (`99999`).
    #[error("proxyconnect tcp: dial tcp: address {addr}: invalid port")]
    InvalidPort { addr: String },
    /// The TCP connection to the proxy (Go wraps it as `proxyconnect tcp: dial tcp …`).
    #[error("proxyconnect tcp: dial tcp {addr}: {}", connect_text(.source))]
    Dial {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake with an `https://` proxy.
    #[error("proxyconnect tcp: {source}")]
    Tls {
        #[source]
        source: std::io::Error,
    },
    /// Writing the CONNECT request or reading its answer.
    #[error("{}", io_error_text(.source))]
    Connect {
        #[source]
        source: std::io::Error,
    },
    /// The answer to CONNECT was not a 200: Go's error is the status text after the code.
    #[error("{0}")]
    Refused(String),
    /// An answer to CONNECT that is not HTTP.
    #[error("malformed HTTP response {0:?}")]
    Malformed(String),
}

impl ProxyError {
    /// The same error again, for one found before any connection was tried (a client that
    /// keeps it to fail every attempt with): the refusals as they are, anything else as its
    /// text.
    pub fn duplicate(&self) -> ProxyError {
        match self {
            ProxyError::Cgi => ProxyError::Cgi,
            ProxyError::UnsupportedScheme { proxy, scheme } => ProxyError::UnsupportedScheme {
                proxy: proxy.clone(),
                scheme: scheme.clone(),
            },
            ProxyError::InvalidPort { addr } => ProxyError::InvalidPort { addr: addr.clone() },
            ProxyError::Refused(t) => ProxyError::Refused(t.clone()),
            ProxyError::Malformed(t) => ProxyError::Malformed(t.clone()),
            other => ProxyError::Malformed(other.to_string()),
        }
    }
}

/// Go's `connect: <errno text>` for a refused or unreachable TCP connection.
fn connect_text(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(_) => format!("connect: {}", io_error_text(e)),
        None => e.to_string(),
    }
}

/// A proxy's URL: Go's `url.URL` of it, the parts a client uses.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl {
    /// Lower case, as Go's parser keeps it.
    pub scheme: String,
    /// The host without brackets or port (Go's `Hostname()`).
    pub host: String,
    /// The port as written, possibly empty (Go's `Port()`).
    pub port: String,
    /// The user and password of `user:password@`, percent-decoded (a user alone when there
    /// is no `:`).
    user: Option<(String, Option<String>)>,
}

impl std::fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}://{}",
            self.scheme,
            join_host_port(&self.host, &self.port)
        )
    }
}

impl std::fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let user = if self.user.is_some() {
            "<redacted>@"
        } else {
            ""
        };
        write!(
            f,
            "ProxyUrl({}://{user}{})",
            self.scheme,
            join_host_port(&self.host, &self.port)
        )
    }
}

/// Go's `net.JoinHostPort`: an IPv6 address (anything with a `:`) in brackets.
pub fn join_host_port(host: &str, port: &str) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Why a kubeconfig's `proxy-url` was refused, in client-go's words (`parseProxyURL`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProxyUrlError {
    #[error("could not parse: {0}")]
    Parse(String),
    #[error("unsupported scheme {0:?}, must be http, https, or socks5")]
    Scheme(String),
}

impl ProxyUrl {
    /// A proxy variable's value as Go's `httpproxy` reads it (`parseProxy`): a URL, or
    /// `host[:port]` taken as `http://host[:port]`; `None` when it is empty or does not parse
    /// (Go ignores it then).
    pub fn from_env_value(value: &str) -> Option<ProxyUrl> {
        if value.is_empty() {
            return None;
        }
        match GoUrl::parse(value) {
            Ok(u) if !u.scheme.is_empty() && !u.host.is_empty() => Some(u.into()),
            first => match GoUrl::parse(&format!("http://{value}")) {
                Ok(u) => Some(u.into()),
                Err(_) => first.ok().map(Into::into),
            },
        }
    }

    /// A kubeconfig cluster's `proxy-url` as client-go reads it: a URL whose scheme is
    /// `http`, `https` or `socks5`.
    pub fn from_kubeconfig(value: &str) -> Result<ProxyUrl, ProxyUrlError> {
        let u = GoUrl::parse(value).map_err(|_| ProxyUrlError::Parse(value.to_string()))?;
        match u.scheme.as_str() {
            "http" | "https" | "socks5" => Ok(u.into()),
            other => Err(ProxyUrlError::Scheme(other.to_string())),
        }
    }

    /// The `Proxy-Authorization` value Go sends when the URL has a user (`Basic`, even for
    /// an empty user or password).
    pub fn authorization(&self) -> Option<String> {
        let (user, password) = self.user.as_ref()?;
        let pair = format!("{user}:{}", password.as_deref().unwrap_or(""));
        Some(format!(
            "Basic {}",
            crate::support::encoding::base64_std(pair.as_bytes())
        ))
    }

    /// The port to dial: the one given, else the scheme's (Go's `canonicalAddr`).
    pub fn port_number(&self) -> Result<u16, ProxyError> {
        let port = match self.port.as_str() {
            "" => match self.scheme.as_str() {
                "http" => "80",
                "https" => "443",
                "socks5" | "socks5h" => "1080",
                _ => "",
            },
            p => p,
        };
        port.parse().map_err(|_| ProxyError::InvalidPort {
            addr: join_host_port(&self.host, port),
        })
    }

    /// `host:port` as dialed (for messages).
    pub fn addr(&self) -> String {
        let port = self
            .port_number()
            .map(|p| p.to_string())
            .unwrap_or_default();
        join_host_port(&self.host, &port)
    }

    /// Whether the proxy itself is reached over TLS.
    pub fn is_https(&self) -> bool {
        self.scheme == "https"
    }

    /// Refuses the schemes this client cannot use (everything but `http` and `https`).
    pub fn check_supported(&self) -> Result<(), ProxyError> {
        match self.scheme.as_str() {
            "http" | "https" => Ok(()),
            other => Err(ProxyError::UnsupportedScheme {
                proxy: self.to_string(),
                scheme: other.to_string(),
            }),
        }
    }
}

/// The proxy settings of an environment: `HTTP_PROXY`, `HTTPS_PROXY`, `NO_PROXY` (or their
/// lower-case forms) and whether `REQUEST_METHOD` is set.
#[derive(Clone, Debug, Default)]
pub struct ProxyEnv {
    http: Option<ProxyUrl>,
    https: Option<ProxyUrl>,
    no_proxy: NoProxy,
    /// client-go's extra CIDRs (apimachinery `NewProxierWithNoProxyCIDR`).
    client_go_cidrs: Vec<IpNet>,
    cgi: bool,
}

/// `NO_PROXY`'s parsed entries (httpproxy's `config.init`).
#[derive(Clone, Debug, Default)]
struct NoProxy {
    all: bool,
    ips: Vec<IpMatcher>,
    domains: Vec<DomainMatch>,
}

#[derive(Clone, Debug)]
enum IpMatcher {
    Cidr(IpNet),
    Ip { ip: IpAddr, port: String },
}

#[derive(Clone, Debug)]
struct DomainMatch {
    /// With its leading `.`.
    host: String,
    port: String,
    /// Whether the bare domain matches too (not given with a leading `.` or `*.`).
    match_host: bool,
}

/// Go's `getEnvAny`: the first of the names whose value is not empty.
fn env_any(env: &dyn Fn(&str) -> Option<String>, names: &[&str]) -> String {
    names
        .iter()
        .find_map(|n| env(n).filter(|v| !v.is_empty()))
        .unwrap_or_default()
}

impl ProxyEnv {
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> ProxyEnv {
        let no_proxy = env_any(env, &["NO_PROXY", "no_proxy"]);
        ProxyEnv {
            http: ProxyUrl::from_env_value(&env_any(env, &["HTTP_PROXY", "http_proxy"])),
            https: ProxyUrl::from_env_value(&env_any(env, &["HTTPS_PROXY", "https_proxy"])),
            client_go_cidrs: no_proxy.split(',').filter_map(parse_cidr_sloppy).collect(),
            no_proxy: NoProxy::parse(&no_proxy),
            cgi: env("REQUEST_METHOD").is_some_and(|v| !v.is_empty()),
        }
    }

    /// This process's environment.
    pub fn from_process() -> ProxyEnv {
        ProxyEnv::from_env(&|k| std::env::var(k).ok())
    }

    /// Whether any proxy is set at all.
    pub fn is_empty(&self) -> bool {
        self.http.is_none() && self.https.is_none()
    }

    /// The proxy Go's `ProxyFromEnvironment` picks for a request to `scheme://host:port`
    /// (`host` without brackets; `port` empty for the scheme's), or `None` for a direct
    /// connection.
    pub fn for_go(
        &self,
        scheme: &str,
        host: &str,
        port: &str,
    ) -> Result<Option<ProxyUrl>, ProxyError> {
        let proxy = match scheme {
            "https" => self.https.as_ref(),
            "http" => match &self.http {
                Some(_) if self.cgi => return Err(ProxyError::Cgi),
                p => p.as_ref(),
            },
            _ => None,
        };
        let Some(proxy) = proxy else {
            return Ok(None);
        };
        let port = match port {
            "" => match scheme {
                "https" => "443",
                _ => "80",
            },
            p => p,
        };
        Ok(self.no_proxy.use_proxy(host, port).then(|| proxy.clone()))
    }

    /// `for_go` behind client-go's own check of `NO_PROXY`'s CIDRs.
    pub fn for_client_go(
        &self,
        scheme: &str,
        host: &str,
        port: &str,
    ) -> Result<Option<ProxyUrl>, ProxyError> {
        if !self.client_go_cidrs.is_empty() {
            if let Some(ip) = parse_ip_sloppy(host) {
                if self.client_go_cidrs.iter().any(|c| c.contains(&ip)) {
                    return Ok(None);
                }
            }
        }
        self.for_go(scheme, host, port)
    }
}

impl NoProxy {
    fn parse(value: &str) -> NoProxy {
        let mut out = NoProxy::default();
        for entry in value.split(',') {
            let p = entry.trim().to_lowercase();
            if p.is_empty() {
                continue;
            }
            if p == "*" {
                return NoProxy {
                    all: true,
                    ..NoProxy::default()
                };
            }
            if let Some(net) = parse_cidr(&p) {
                out.ips.push(IpMatcher::Cidr(net));
                continue;
            }
            let (mut host, port) = match split_host_port(&p) {
                Some((h, port)) => {
                    if h.is_empty() {
                        continue;
                    }
                    (h, port)
                }
                None => (p.as_str(), ""),
            };
            if host.len() >= 2 && host.starts_with('[') && host.ends_with(']') {
                host = &host[1..host.len() - 1];
            }
            if let Some(ip) = parse_go_ip(host) {
                out.ips.push(IpMatcher::Ip {
                    ip,
                    port: port.to_string(),
                });
                continue;
            }
            if host.is_empty() {
                continue;
            }
            let host = if host.starts_with("*.") {
                &host[1..]
            } else {
                host
            };
            let (host, match_host) = match host.strip_prefix('.') {
                Some(_) => (host.to_string(), false),
                None => (format!(".{host}"), true),
            };
            out.domains.push(DomainMatch {
                host,
                port: port.to_string(),
                match_host,
            });
        }
        out
    }

    /// httpproxy's `useProxy` for `host` (no brackets) and `port`.
    fn use_proxy(&self, host: &str, port: &str) -> bool {
        if host == "localhost" {
            return false;
        }
        let ip = parse_go_addr(host).map(|ip| ip.to_canonical());
        if ip.is_some_and(|ip| ip.is_loopback()) {
            return false;
        }
        if self.all {
            return false;
        }
        let host = host.trim().to_lowercase();
        if let Some(ip) = ip {
            for m in &self.ips {
                let hit = match m {
                    IpMatcher::Cidr(net) => net.contains(&ip),
                    IpMatcher::Ip { ip: want, port: p } => {
                        want.to_canonical() == ip && (p.is_empty() || p == port)
                    }
                };
                if hit {
                    return false;
                }
            }
            // Domain entries never match an IP.
            return true;
        }
        !self.domains.iter().any(|m| {
            (host.ends_with(&m.host) || (m.match_host && host == m.host[1..]))
                && (m.port.is_empty() || m.port == port)
        })
    }
}

/// Go's `net.SplitHostPort` (brackets kept off the host), `None` where Go errs.
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    let colon = s.rfind(':')?;
    let (host, port) = (&s[..colon], &s[colon + 1..]);
    if let Some(inner) = host.strip_prefix('[') {
        let inner = inner.strip_suffix(']')?;
        if inner.contains(['[', ']']) {
            return None;
        }
        return Some((inner, port));
    }
    if host.contains([':', '[', ']']) || port.contains(['[', ']']) {
        return None;
    }
    Some((host, port))
}

/// Go's `net.ParseIP` (no zone; IPv4 without leading zeros).
fn parse_go_ip(s: &str) -> Option<IpAddr> {
    s.parse().ok()
}

/// Go's `netip.ParseAddr`: `net.ParseIP`'s forms, and an IPv6 zone (`fe80::1%eth0`).
fn parse_go_addr(s: &str) -> Option<IpAddr> {
    match s.split_once('%') {
        Some((addr, zone)) if !zone.is_empty() && addr.contains(':') => {
            addr.parse::<std::net::Ipv6Addr>().ok().map(IpAddr::V6)
        }
        Some(_) => None,
        None => s.parse().ok(),
    }
}

/// Go's `net.ParseCIDR`, an IPv4-mapped IPv6 network taken as the IPv4 one it maps (as Go's
/// `IPNet.Contains` treats it).
fn parse_cidr(s: &str) -> Option<IpNet> {
    canonical_net(s.parse().ok()?)
}

fn canonical_net(net: IpNet) -> Option<IpNet> {
    match net.addr {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) if net.prefix >= 96 => IpNet::new(IpAddr::V4(v4), net.prefix - 96),
            _ => Some(net),
        },
        IpAddr::V4(_) => Some(net),
    }
}

/// k8s.io/utils' `ParseIPSloppy`: as Go's parser before 1.17, IPv4 octets may have leading
/// zeros (read as decimal). The input is not trimmed.
fn parse_ip_sloppy(s: &str) -> Option<IpAddr> {
    if s.contains(':') {
        return s.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
    }
    let mut octets = [0u8; 4];
    let mut parts = s.split('.');
    for o in &mut octets {
        let part = parts.next()?;
        if part.is_empty() || part.len() > 3 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        *o = part.parse().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(IpAddr::V4(Ipv4Addr::from(octets)))
}

/// k8s.io/utils' `ParseCIDRSloppy` (on the untrimmed entry, as apimachinery passes it).
fn parse_cidr_sloppy(s: &str) -> Option<IpNet> {
    let (addr, prefix) = s.split_once('/')?;
    let addr = parse_ip_sloppy(addr)?;
    if prefix.is_empty() || prefix.len() > 3 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    IpNet::new(addr, prefix.parse().ok()?)
}

/// The parts of Go's `url.Parse` result a proxy URL needs.
#[derive(Debug, Clone, PartialEq, Eq)]
struct GoUrl {
    scheme: String,
    /// The authority's host with its port, as Go keeps `URL.Host`.
    host: String,
    user: Option<(String, Option<String>)>,
}

impl From<GoUrl> for ProxyUrl {
    fn from(u: GoUrl) -> ProxyUrl {
        let (host, port) = go_host_port(&u.host);
        ProxyUrl {
            scheme: u.scheme,
            host,
            port,
            user: u.user,
        }
    }
}

/// Go's `URL.Hostname()` and `URL.Port()` of a `URL.Host` (its `splitHostPort`).
fn go_host_port(host_port: &str) -> (String, String) {
    let (mut host, mut port) = (host_port, "");
    if let Some(colon) = host.rfind(':') {
        if valid_optional_port(&host[colon..]) {
            (host, port) = (&host[..colon], &host[colon + 1..]);
        }
    }
    if host.len() >= 2 && host.starts_with('[') && host.ends_with(']') {
        host = &host[1..host.len() - 1];
    }
    (host.to_string(), port.to_string())
}

/// Why Go's `url.Parse` refused a URL (the kind is enough: every caller replaces the text).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct UrlError;

impl GoUrl {
    /// Go's `url.Parse`, for what decides its success and a proxy's scheme, host and user.
    fn parse(raw: &str) -> Result<GoUrl, UrlError> {
        let raw = raw.split_once('#').map_or(raw, |(u, _)| u);
        if raw.bytes().any(|b| b < 0x20 || b == 0x7f) {
            return Err(UrlError);
        }
        let (scheme, rest) = get_scheme(raw)?;
        let scheme = scheme.to_ascii_lowercase();
        let rest = rest.split_once('?').map_or(rest, |(r, _)| r);
        let mut url = GoUrl {
            scheme,
            host: String::new(),
            user: None,
        };
        if !rest.starts_with('/') {
            if !url.scheme.is_empty() {
                // Opaque (`host:port` read as scheme `host`): no host.
                return Ok(url);
            }
            let segment = rest.split('/').next().unwrap_or("");
            if segment.contains(':') {
                return Err(UrlError);
            }
        }
        let mut path = rest;
        if (!url.scheme.is_empty() || !rest.starts_with("///")) && rest.starts_with("//") {
            let after = &rest[2..];
            let (authority, tail) = match after.find('/') {
                Some(i) => (&after[..i], &after[i..]),
                None => (after, ""),
            };
            let (user, host) = parse_authority(authority)?;
            url.user = user;
            url.host = host;
            path = tail;
        }
        unescape(path, Mode::Path)?;
        Ok(url)
    }
}

/// Go's `getScheme`.
fn get_scheme(raw: &str) -> Result<(&str, &str), UrlError> {
    for (i, c) in raw.bytes().enumerate() {
        match c {
            b'a'..=b'z' | b'A'..=b'Z' => {}
            b'0'..=b'9' | b'+' | b'-' | b'.' => {
                if i == 0 {
                    return Ok(("", raw));
                }
            }
            b':' => {
                if i == 0 {
                    return Err(UrlError);
                }
                return Ok((&raw[..i], &raw[i + 1..]));
            }
            _ => return Ok(("", raw)),
        }
    }
    Ok(("", raw))
}

type Userinfo = Option<(String, Option<String>)>;

/// Go's `parseAuthority`: the user (and password) and `URL.Host`.
fn parse_authority(authority: &str) -> Result<(Userinfo, String), UrlError> {
    let at = authority.rfind('@');
    let host = parse_host(at.map_or(authority, |i| &authority[i + 1..]))?;
    let Some(i) = at else {
        return Ok((None, host));
    };
    let userinfo = &authority[..i];
    let valid = userinfo
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-._:~!$&'()*+,;=%@".contains(c));
    if !valid {
        return Err(UrlError);
    }
    let user = match userinfo.split_once(':') {
        None => (unescape(userinfo, Mode::User)?, None),
        Some((u, p)) => (unescape(u, Mode::User)?, Some(unescape(p, Mode::User)?)),
    };
    Ok((Some(user), host))
}

/// Go's `validOptionalPort`.
fn valid_optional_port(port: &str) -> bool {
    match port.strip_prefix(':') {
        None => port.is_empty(),
        Some(digits) => digits.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// Go's `parseHost`, as upstream's binary runs it: built with `urlstrictcolons=0` (its
/// `go.mod` says Go 1.25), so the port is what follows the last colon whatever the scheme.
fn parse_host(host: &str) -> Result<String, UrlError> {
    match host.rfind('[') {
        Some(i) if i > 0 => return Err(UrlError),
        Some(_) => {
            let close = host.rfind(']').ok_or(UrlError)?;
            let colon_port = &host[close + 1..];
            if !valid_optional_port(colon_port) {
                return Err(UrlError);
            }
            let name = &host[1..close];
            let addr = match name.find("%25") {
                Some(z) => {
                    unescape(&name[z..], Mode::Zone)?;
                    unescape(&name[..z], Mode::Host)?
                }
                None => unescape(name, Mode::Host)?,
            };
            match addr.parse::<IpAddr>() {
                Ok(IpAddr::V6(_)) => {}
                _ => return Err(UrlError),
            }
            return Ok(host.to_string());
        }
        None => {}
    }
    if let Some(last) = host.rfind(':') {
        if !valid_optional_port(&host[last..]) {
            return Err(UrlError);
        }
    }
    unescape(host, Mode::Host)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Path,
    Host,
    Zone,
    User,
}

/// Whether Go's `shouldEscape` says `c` may not appear as it is in a host.
fn host_char_invalid(c: u8) -> bool {
    !(c.is_ascii_alphanumeric() || b"-_.~!$&'()*+,;=:[]<>\"".contains(&c))
}

/// Go's `unescape` for the modes used here: `%XX` must be well formed; a host escapes only
/// non-ASCII bytes (or `%25`) and has no other ASCII than its allowed characters.
fn unescape(s: &str, mode: Mode) -> Result<String, UrlError> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = |c: u8| (c as char).to_digit(16);
                let (Some(hi), Some(lo)) = (
                    b.get(i + 1).and_then(|c| hex(*c)),
                    b.get(i + 2).and_then(|c| hex(*c)),
                ) else {
                    return Err(UrlError);
                };
                if mode == Mode::Host && hi < 8 && &s[i..i + 3] != "%25" {
                    return Err(UrlError);
                }
                let v = (hi << 4 | lo) as u8;
                if mode == Mode::Zone && &s[i..i + 3] != "%25" && v != b' ' && host_char_invalid(v)
                {
                    return Err(UrlError);
                }
                out.push(v);
                i += 3;
            }
            c => {
                if matches!(mode, Mode::Host | Mode::Zone) && c < 0x80 && host_char_invalid(c) {
                    return Err(UrlError);
                }
                out.push(c);
                i += 1;
            }
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Connects to `proxy` (TCP, then TLS with `tls` for an `https://` proxy). Errors are Go's
/// `proxyconnect tcp: …`.
pub async fn connect(
    proxy: &ProxyUrl,
    tls: Option<&tokio_rustls::TlsConnector>,
) -> Result<BoxIo, ProxyError> {
    proxy.check_supported()?;
    let port = proxy.port_number()?;
    let tcp = TcpStream::connect((proxy.host.as_str(), port))
        .await
        .map_err(|source| ProxyError::Dial {
            addr: proxy.addr(),
            source,
        })?;
    tcp.set_nodelay(true).map_err(|source| ProxyError::Dial {
        addr: proxy.addr(),
        source,
    })?;
    if !proxy.is_https() {
        return Ok(BoxIo::new(tcp));
    }
    let Some(tls) = tls else {
        return Err(ProxyError::Tls {
            source: std::io::Error::other("no TLS configuration for an https proxy"),
        });
    };
    let name = rustls_pki_types::ServerName::try_from(proxy.host.clone()).map_err(|e| {
        ProxyError::Tls {
            source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
        }
    })?;
    let stream = tls
        .connect(name, tcp)
        .await
        .map_err(|source| ProxyError::Tls { source })?;
    Ok(BoxIo::new(stream))
}

/// The largest CONNECT answer read (Go reads up to 10 MB of headers; no proxy sends more
/// than a few hundred bytes).
const MAX_CONNECT_ANSWER: usize = 64 * 1024;

/// Asks the proxy on `io` for a tunnel to `target` (`host:port`), as Go's transport does:
/// `CONNECT target HTTP/1.1`, `Host: target`, Go's User-Agent and the proxy's
/// `Proxy-Authorization`; anything but a 200 is refused with the status text.
pub async fn tunnel(io: &mut BoxIo, target: &str, proxy: &ProxyUrl) -> Result<(), ProxyError> {
    let mut req = format!(
        "CONNECT {target} HTTP/1.1\r\nHost: {target}\r\nUser-Agent: Go-http-client/1.1\r\n"
    );
    if let Some(auth) = proxy.authorization() {
        req.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
    }
    req.push_str("\r\n");
    let io_err = |source| ProxyError::Connect { source };
    io.write_all(req.as_bytes()).await.map_err(io_err)?;
    io.flush().await.map_err(io_err)?;
    // Byte by byte up to the blank line: the server speaks first only after our TLS hello,
    // so nothing of the tunnel is read here.
    let mut head = Vec::with_capacity(256);
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && !head.ends_with(b"\n\n") {
        if head.len() >= MAX_CONNECT_ANSWER {
            return Err(ProxyError::Malformed("header too long".into()));
        }
        match io.read(&mut byte).await.map_err(io_err)? {
            0 => {
                return Err(io_err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "unexpected EOF",
                )))
            }
            _ => head.push(byte[0]),
        }
    }
    let text = String::from_utf8_lossy(&head);
    let line = text.lines().next().unwrap_or_default();
    let Some(status) = line.strip_prefix("HTTP/").and_then(|l| l.split_once(' ')) else {
        return Err(ProxyError::Malformed(line.to_string()));
    };
    let status = status.1.trim();
    let code = status.get(..3).unwrap_or(status);
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ProxyError::Malformed(line.to_string()));
    }
    if code == "200" {
        return Ok(());
    }
    match status.split_once(' ') {
        Some((_, text)) => Err(ProxyError::Refused(text.to_string())),
        None => Err(ProxyError::Refused("unknown status code".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> ProxyEnv {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        ProxyEnv::from_env(&|k| m.get(k).cloned())
    }

    fn via(e: &ProxyEnv, url: &str) -> Option<String> {
        let (scheme, rest) = url.split_once("://").unwrap();
        let (host, port) = go_host_port(rest);
        e.for_go(scheme, &host, &port)
            .unwrap()
            .map(|p| p.to_string())
    }

    #[test]
    fn proxy_values_as_go_reads_them() {
        let p = ProxyUrl::from_env_value("proxy.corp:3128").unwrap();
        assert_eq!(p.to_string(), "http://proxy.corp:3128");
        let p = ProxyUrl::from_env_value("10.0.0.1:3128").unwrap();
        assert_eq!(
            (p.scheme.as_str(), p.host.as_str(), p.port.as_str()),
            ("http", "10.0.0.1", "3128")
        );
        let p = ProxyUrl::from_env_value("https://[fd00::1]:8443/").unwrap();
        assert_eq!(
            (p.scheme.as_str(), p.host.as_str(), p.port.as_str()),
            ("https", "fd00::1", "8443")
        );
        assert_eq!(p.port_number().unwrap(), 8443);
        assert_eq!(
            ProxyUrl::from_env_value("http://p")
                .unwrap()
                .port_number()
                .unwrap(),
            80
        );
        assert_eq!(
            ProxyUrl::from_env_value("HTTPS://p")
                .unwrap()
                .port_number()
                .unwrap(),
            443
        );
        // A value that does not parse is tried again after `http://`, which makes Go's
        // proxy of a bad `http://…` value the host `http` (checked against Go 1.26).
        for bad in ["http://a b:1", "http://p:port", "http://"] {
            assert_eq!(
                ProxyUrl::from_env_value(bad).unwrap().to_string(),
                "http://http:",
                "{bad}"
            );
        }
        // One that parses only as a path is kept, schemeless (Go then fails to dial it).
        assert_eq!(ProxyUrl::from_env_value("a b").unwrap().to_string(), "://:");
        assert_eq!(ProxyUrl::from_env_value("%zz"), None);
        assert_eq!(ProxyUrl::from_env_value(""), None);
        // Upstream's build takes the last colon's port (`urlstrictcolons=0`).
        let p = ProxyUrl::from_env_value("http://a:1:2").unwrap();
        assert_eq!((p.host.as_str(), p.port.as_str()), ("a:1", "2"));
    }

    #[test]
    fn credentials_make_basic_auth_and_are_never_shown() {
        let p = ProxyUrl::from_env_value("http://us%40er:p%3Ass@proxy:3128").unwrap();
        assert_eq!(
            p.authorization().unwrap(),
            format!(
                "Basic {}",
                crate::support::encoding::base64_std(b"us@er:p:ss")
            )
        );
        assert!(!format!("{p} {p:?}").contains("p:ss") && !format!("{p:?}").contains("p%3Ass"));
        assert_eq!(p.to_string(), "http://proxy:3128");
        // A user alone: an empty password. `@` in the password: the last `@` ends it.
        let p = ProxyUrl::from_env_value("http://u@proxy").unwrap();
        assert_eq!(
            p.authorization().unwrap(),
            format!("Basic {}", crate::support::encoding::base64_std(b"u:"))
        );
        let p = ProxyUrl::from_env_value("http://u:p@ss@proxy").unwrap();
        assert_eq!(
            p.authorization().unwrap(),
            format!("Basic {}", crate::support::encoding::base64_std(b"u:p@ss"))
        );
        assert_eq!(
            ProxyUrl::from_env_value("http://proxy")
                .unwrap()
                .authorization(),
            None
        );
    }

    #[test]
    fn kubeconfig_proxy_urls_as_client_go_reads_them() {
        assert!(ProxyUrl::from_kubeconfig("http://p:3128").is_ok());
        assert!(ProxyUrl::from_kubeconfig("socks5://p:1080").is_ok());
        assert_eq!(
            ProxyUrl::from_kubeconfig("ftp://p")
                .unwrap_err()
                .to_string(),
            "unsupported scheme \"ftp\", must be http, https, or socks5"
        );
        // No scheme: url.Parse gives an empty one.
        assert_eq!(
            ProxyUrl::from_kubeconfig("p:3128").unwrap_err().to_string(),
            "unsupported scheme \"p\", must be http, https, or socks5"
        );
        assert_eq!(
            ProxyUrl::from_kubeconfig("http://a b")
                .unwrap_err()
                .to_string(),
            "could not parse: http://a b"
        );
    }

    #[test]
    fn scheme_picks_the_variable_upper_case_first() {
        let e = env(&[
            ("HTTPS_PROXY", "http://up:1"),
            ("https_proxy", "http://low:2"),
            ("http_proxy", "low3:3"),
        ]);
        assert_eq!(
            via(&e, "https://10.0.0.1:6443").as_deref(),
            Some("http://up:1")
        );
        assert_eq!(
            via(&e, "http://10.0.0.1:8080").as_deref(),
            Some("http://low3:3")
        );
        // An empty upper-case value: the lower-case one.
        let e = env(&[("HTTPS_PROXY", ""), ("https_proxy", "http://low:2")]);
        assert_eq!(via(&e, "https://h").as_deref(), Some("http://low:2"));
        assert_eq!(via(&e, "http://h"), None);
        assert!(env(&[]).is_empty());
    }

    #[test]
    fn localhost_and_loopback_are_never_proxied() {
        let e = env(&[("HTTPS_PROXY", "p:1"), ("HTTP_PROXY", "p:1")]);
        for url in [
            "https://localhost:6443",
            "https://127.0.0.1",
            "https://127.9.9.9:1",
            "http://[::1]:80",
            "https://[::ffff:127.0.0.1]",
        ] {
            assert_eq!(via(&e, url), None, "{url}");
        }
        // Only the exact name.
        assert!(via(&e, "https://localhost.localdomain").is_some());
        assert!(via(&e, "https://LOCALHOST").is_some());
        assert!(via(&e, "https://10.0.0.1").is_some());
    }

    #[test]
    fn no_proxy_rules() {
        let e = env(&[
            ("HTTPS_PROXY", "p:1"),
            ("NO_PROXY", " Example.com, .svc ,*.cluster.local,10.96.0.0/12,192.168.1.5,[fd00::5]:6443,api.corp:8443,fd10::/64,:80,"),
        ]);
        let proxied = |u: &str| via(&e, u).is_some();
        // Domains: the name and its subdomains, case-insensitively.
        assert!(!proxied("https://example.com"));
        assert!(!proxied("https://API.example.com:6443"));
        assert!(proxied("https://notexample.com.evil"));
        // A suffix matches on the string: `badexample.com` ends with `example.com`? Go
        // compares with the leading dot, so no.
        assert!(proxied("https://badexample.com"));
        // Leading `.` and `*.`: subdomains only.
        assert!(!proxied("https://kubernetes.default.svc"));
        assert!(proxied("https://svc"));
        assert!(!proxied("https://a.cluster.local"));
        assert!(proxied("https://cluster.local"));
        // CIDRs and IPs, with a port when given.
        assert!(!proxied("https://10.96.0.1"));
        assert!(proxied("https://10.112.0.1"));
        assert!(!proxied("https://192.168.1.5:6443"));
        assert!(!proxied("https://[fd00::5]:6443"));
        assert!(proxied("https://[fd00::5]:443"));
        assert!(!proxied("https://[fd10::1]"));
        // A domain entry with a port: that port only (the default one when none is given).
        assert!(!proxied("https://api.corp:8443"));
        assert!(proxied("https://api.corp"));
        // Domain entries never match an IP, IP entries never a name.
        let e2 = env(&[("HTTPS_PROXY", "p:1"), ("NO_PROXY", "10.0.0.1,0.0.2")]);
        assert!(via(&e2, "https://10.0.0.1.example").is_some());
        assert!(via(&e2, "https://10.0.0.2").is_some());
        // `*` alone: nothing is proxied.
        let all = env(&[("HTTPS_PROXY", "p:1"), ("no_proxy", "foo,*")]);
        assert_eq!(via(&all, "https://anything:1"), None);
        // `*` as part of an entry is no wildcard: `*x` is the domain `*x`.
        let star = env(&[("HTTPS_PROXY", "p:1"), ("NO_PROXY", "*x")]);
        assert!(via(&star, "https://ax").is_some());
        assert!(via(&star, "https://a.*x").is_none());
    }

    #[test]
    fn client_go_adds_sloppy_cidrs() {
        let e = env(&[("HTTPS_PROXY", "p:1"), ("NO_PROXY", "010.0.0.0/8")]);
        // Go's own parser refuses the leading zero; client-go's takes it.
        assert!(e.for_go("https", "10.1.2.3", "").unwrap().is_some());
        assert!(e.for_client_go("https", "10.1.2.3", "").unwrap().is_none());
        assert!(e.for_client_go("https", "11.1.2.3", "").unwrap().is_some());
    }

    #[test]
    fn cgi_refuses_http_proxy_only() {
        let e = env(&[
            ("HTTP_PROXY", "p:1"),
            ("HTTPS_PROXY", "p:1"),
            ("REQUEST_METHOD", "GET"),
        ]);
        assert_eq!(
            e.for_go("http", "h", "").unwrap_err().to_string(),
            "refusing to use HTTP_PROXY value in CGI environment; see golang.org/s/cgihttpproxy"
        );
        assert!(e.for_go("https", "h", "").unwrap().is_some());
        // Excluded or not, the refusal comes first (Go checks it before NO_PROXY).
        assert!(e.for_go("http", "localhost", "").is_err());
    }

    #[test]
    fn go_url_parse_edges() {
        assert_eq!(
            GoUrl::parse("http://[fd00::1]:80").unwrap().host,
            "[fd00::1]:80"
        );
        assert!(GoUrl::parse("http://[10.0.0.1]").is_err());
        assert!(GoUrl::parse("http://x[y]").is_err());
        assert!(GoUrl::parse("http://h:8%30").is_err());
        assert!(GoUrl::parse(":foo").is_err());
        assert!(GoUrl::parse("a:b/c").unwrap().host.is_empty());
        assert!(
            GoUrl::parse("1.2.3.4:80").is_err(),
            "colon in the first path segment"
        );
        assert!(GoUrl::parse("http://u ser@h").is_err());
        assert!(GoUrl::parse("http://h/%zz").is_err());
        assert_eq!(GoUrl::parse("http://h?x#y").unwrap().host, "h");
        assert_eq!(GoUrl::parse("socks5://a:1:2").unwrap().host, "a:1:2");
        assert!(GoUrl::parse("http://a:1:x").is_err());
        assert_eq!(
            go_host_port("[fd00::1]"),
            ("fd00::1".to_string(), String::new())
        );
        assert_eq!(go_host_port("a:1:2"), ("a:1".to_string(), "2".to_string()));
    }

    #[tokio::test]
    async fn tunnel_sends_connect_and_reads_the_answer() {
        use tokio::io::AsyncBufReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let mut seen = Vec::new();
            for answer in [
                "HTTP/1.1 200 Connection established\r\n\r\n",
                "HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic\r\n\r\n",
                "HTTP/1.0 403\r\n\r\n",
                "SSH-2.0\r\n\r\n",
            ] {
                let (s, _) = listener.accept().await.unwrap();
                let mut s = tokio::io::BufReader::new(s);
                let mut head = String::new();
                loop {
                    let mut line = String::new();
                    s.read_line(&mut line).await.unwrap();
                    head.push_str(&line);
                    if line == "\r\n" {
                        break;
                    }
                }
                s.get_mut().write_all(answer.as_bytes()).await.unwrap();
                seen.push(head);
            }
            seen
        });
        let proxy = ProxyUrl::from_env_value(&format!("http://u:pw@{addr}")).unwrap();
        let mut results = Vec::new();
        for _ in 0..4 {
            let mut io = connect(&proxy, None).await.unwrap();
            results.push(
                tunnel(&mut io, "kube.test:6443", &proxy)
                    .await
                    .map_err(|e| e.to_string()),
            );
        }
        assert_eq!(
            results,
            vec![
                Ok(()),
                Err("Proxy Authentication Required".to_string()),
                Err("unknown status code".to_string()),
                Err("malformed HTTP response \"SSH-2.0\"".to_string()),
            ]
        );
        let seen = server.await.unwrap();
        assert_eq!(
            seen[0],
            format!(
                "CONNECT kube.test:6443 HTTP/1.1\r\nHost: kube.test:6443\r\nUser-Agent: Go-http-client/1.1\r\nProxy-Authorization: Basic {}\r\n\r\n",
                crate::support::encoding::base64_std(b"u:pw")
            )
        );
    }

    #[tokio::test]
    async fn a_dead_proxy_is_named_as_go_names_it() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let proxy = ProxyUrl::from_env_value(&addr.to_string()).unwrap();
        let e = connect(&proxy, None).await.err().unwrap();
        assert_eq!(
            e.to_string(),
            format!("proxyconnect tcp: dial tcp {addr}: connect: connection refused")
        );
        let socks = ProxyUrl::from_env_value("socks5://127.0.0.1:1080").unwrap();
        assert!(connect(&socks, None)
            .await
            .err()
            .unwrap()
            .to_string()
            .contains("not supported"));
    }
}
