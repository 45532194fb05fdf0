//! etcd endpoint discovery by DNS SRV records (`etcd_discovery_srv`, libcalico-go's etcdv3
//! backend via etcd's `srv.GetClient("etcd-client", domain, "")`): the records
//! `_etcd-client-ssl._tcp.<domain>` give `https://<target>:<port>` endpoints, then
//! `_etcd-client._tcp.<domain>` give `http://…` ones (targets keep their trailing dot, as
//! Go's `net.JoinHostPort(srv.Target, …)` leaves it). Only when both lookups fail is it an
//! error: `dns lookup errors: <https error> and <http error>`.
//!
//! A small stub resolver: one UDP query per nameserver of /etc/resolv.conf (in order, each
//! bounded), answers parsed for SRV records. Errors read like Go's `net.DNSError`.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use tokio::net::UdpSocket;

const RESOLV_CONF: &str = "/etc/resolv.conf";
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);
const TYPE_SRV: u16 = 33;
const CLASS_IN: u16 = 1;

/// One SRV record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Srv {
    pub priority: u16,
    pub weight: u16,
    pub port: u16,
    /// The target name with its trailing dot (`etcd1.example.com.`).
    pub target: String,
}

/// The client endpoints for `domain`, https ones first.
pub async fn discover_etcd_endpoints(domain: &str) -> Result<Vec<String>, String> {
    let servers = nameservers(&std::fs::read_to_string(RESOLV_CONF).unwrap_or_default());
    let https = lookup_srv(&servers, &format!("_etcd-client-ssl._tcp.{domain}")).await;
    let http = lookup_srv(&servers, &format!("_etcd-client._tcp.{domain}")).await;
    let mut out = Vec::new();
    match (&https, &http) {
        (Err(a), Err(b)) => return Err(format!("dns lookup errors: {a} and {b}")),
        _ => {
            for (scheme, records) in [("https", https.ok()), ("http", http.ok())] {
                for r in records.into_iter().flatten() {
                    out.push(format!("{scheme}://{}:{}", r.target, r.port));
                }
            }
        }
    }
    Ok(out)
}

/// The `nameserver` entries of a resolv.conf (Go's default, the local resolver, when none).
pub fn nameservers(resolv_conf: &str) -> Vec<SocketAddr> {
    let mut out: Vec<SocketAddr> = resolv_conf
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next()).flatten()
        })
        .filter_map(|a| a.split('%').next()?.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .take(3)
        .collect();
    if out.is_empty() {
        out.push(SocketAddr::from(([127, 0, 0, 1], 53)));
    }
    out
}

/// SRV records for `name`, sorted by priority and then by descending weight.
async fn lookup_srv(servers: &[SocketAddr], name: &str) -> Result<Vec<Srv>, String> {
    let mut last = format!("lookup {name}: no such host");
    for server in servers {
        let err = |reason: &str| format!("lookup {name} on {server}: {reason}");
        // Each query is also cut at the call's deadline.
        let (until, capped) = crate::support::deadline::cap_at(QUERY_TIMEOUT);
        let answer = match tokio::time::timeout_at(until, query(*server, name)).await {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                last = err(&e);
                continue;
            }
            Err(_) if capped => {
                let what = format!("looking up {name} on {server}");
                return Err(crate::support::deadline::expired(what).to_string());
            }
            Err(_) => {
                last = err("i/o timeout");
                continue;
            }
        };
        return match parse_answer(&answer) {
            Ok(mut records) if !records.is_empty() => {
                records.sort_by(|a, b| a.priority.cmp(&b.priority).then(b.weight.cmp(&a.weight)));
                Ok(records)
            }
            Ok(_) => Err(err("no such host")),
            Err(e) => Err(err(&e)),
        };
    }
    Err(last)
}

async fn query(server: SocketAddr, name: &str) -> Result<Vec<u8>, String> {
    let bind: SocketAddr = if server.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        ([0u16; 8], 0).into()
    };
    let sock = UdpSocket::bind(bind).await.map_err(|e| e.to_string())?;
    let id = (std::process::id() as u16) ^ 0x5ca1;
    sock.send_to(&build_query(id, name), server)
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, from) = sock.recv_from(&mut buf).await.map_err(|e| e.to_string())?;
        if from == server && n >= 12 && u16::from_be_bytes([buf[0], buf[1]]) == id {
            buf.truncate(n);
            return Ok(buf);
        }
    }
}

/// A standard recursive query for `name` IN SRV.
pub fn build_query(id: u16, name: &str) -> Vec<u8> {
    let mut q = Vec::with_capacity(64);
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.trim_end_matches('.').split('.') {
        q.push(label.len().min(63) as u8);
        q.extend_from_slice(&label.as_bytes()[..label.len().min(63)]);
    }
    q.push(0);
    q.extend_from_slice(&TYPE_SRV.to_be_bytes());
    q.extend_from_slice(&CLASS_IN.to_be_bytes());
    q
}

/// Reads a (possibly compressed) name at `pos`; returns it with a trailing dot and the
/// position after it in the original stream.
fn read_name(msg: &[u8], mut pos: usize) -> Result<(String, usize), String> {
    let bad = || "cannot unmarshal DNS message".to_string();
    let mut name = String::new();
    let mut end = None;
    for _ in 0..128 {
        let len = *msg.get(pos).ok_or_else(bad)? as usize;
        if len == 0 {
            let after = end.unwrap_or(pos + 1);
            if name.is_empty() {
                name.push('.');
            }
            return Ok((name, after));
        }
        if len & 0xc0 == 0xc0 {
            let lo = *msg.get(pos + 1).ok_or_else(bad)? as usize;
            end.get_or_insert(pos + 2);
            pos = ((len & 0x3f) << 8) | lo;
            continue;
        }
        let label = msg.get(pos + 1..pos + 1 + len).ok_or_else(bad)?;
        name.push_str(&String::from_utf8_lossy(label));
        name.push('.');
        pos += 1 + len;
    }
    Err(bad())
}

fn u16_at(msg: &[u8], pos: usize) -> Result<u16, String> {
    msg.get(pos..pos + 2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]))
        .ok_or_else(|| "cannot unmarshal DNS message".to_string())
}

/// The SRV records of a response; the response code as Go words it.
pub fn parse_answer(msg: &[u8]) -> Result<Vec<Srv>, String> {
    let flags = u16_at(msg, 2)?;
    match flags & 0x000f {
        0 => {}
        3 => return Err("no such host".into()),
        2 => return Err("server misbehaving".into()),
        rcode => return Err(format!("server misbehaving (rcode {rcode})")),
    }
    let (qd, an) = (u16_at(msg, 4)?, u16_at(msg, 6)?);
    let mut pos = 12;
    for _ in 0..qd {
        pos = read_name(msg, pos)?.1 + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        let after_name = read_name(msg, pos)?.1;
        let rtype = u16_at(msg, after_name)?;
        let rdlen = u16_at(msg, after_name + 8)? as usize;
        let rdata = after_name + 10;
        if rtype == TYPE_SRV {
            out.push(Srv {
                priority: u16_at(msg, rdata)?,
                weight: u16_at(msg, rdata + 2)?,
                port: u16_at(msg, rdata + 4)?,
                target: read_name(msg, rdata + 6)?.0,
            });
        }
        pos = rdata + rdlen;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response to `build_query(7, name)` with the given SRV (priority, port, target).
    pub fn response(name: &str, rcode: u8, records: &[(u16, u16, &str)]) -> Vec<u8> {
        let q = build_query(7, name);
        let mut m = q.clone();
        m[2] = 0x81;
        m[3] = 0x80 | rcode;
        m[7] = records.len() as u8;
        for (prio, port, target) in records {
            m.extend_from_slice(&[0xc0, 12]); // the question's name, compressed
            m.extend_from_slice(&TYPE_SRV.to_be_bytes());
            m.extend_from_slice(&CLASS_IN.to_be_bytes());
            m.extend_from_slice(&[0, 0, 0, 60]);
            let mut rdata = Vec::new();
            rdata.extend_from_slice(&prio.to_be_bytes());
            rdata.extend_from_slice(&10u16.to_be_bytes());
            rdata.extend_from_slice(&port.to_be_bytes());
            for label in target.trim_end_matches('.').split('.') {
                rdata.push(label.len() as u8);
                rdata.extend_from_slice(label.as_bytes());
            }
            rdata.push(0);
            m.extend_from_slice(&(rdata.len() as u16).to_be_bytes());
            m.extend_from_slice(&rdata);
        }
        m
    }

    #[test]
    fn answers_and_errors() {
        let name = "_etcd-client._tcp.example.com";
        let r = parse_answer(&response(
            name,
            0,
            &[(10, 2379, "e2.example.com"), (0, 2380, "e1.example.com")],
        ))
        .unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].target, "e1.example.com.");
        assert_eq!((r[1].priority, r[1].port), (0, 2380));
        assert_eq!(
            parse_answer(&response(name, 3, &[])).unwrap_err(),
            "no such host"
        );
        assert_eq!(
            parse_answer(&response(name, 2, &[])).unwrap_err(),
            "server misbehaving"
        );
        assert!(parse_answer(&[0, 1]).is_err());
    }

    #[test]
    fn resolv_conf() {
        let ns = nameservers(
            "# c\nsearch x\nnameserver 10.0.0.2\nnameserver fe80::1%eth0\noptions ndots:5\n",
        );
        assert_eq!(
            ns,
            vec![
                "10.0.0.2:53".parse().unwrap(),
                "[fe80::1]:53".parse().unwrap()
            ]
        );
        assert_eq!(nameservers(""), vec!["127.0.0.1:53".parse().unwrap()]);
    }

    #[tokio::test]
    async fn discovers_through_a_local_server() {
        let server = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = [0u8; 512];
            for _ in 0..2 {
                let (n, from) = server.recv_from(&mut buf).await.unwrap();
                let (qname, _) = read_name(&buf[..n], 12).unwrap();
                let qname = qname.trim_end_matches('.');
                let mut resp = if qname.starts_with("_etcd-client-ssl") {
                    response(qname, 3, &[])
                } else {
                    response(qname, 0, &[(0, 2379, "localhost")])
                };
                resp[0..2].copy_from_slice(&buf[0..2]);
                server.send_to(&resp, from).await.unwrap();
            }
        });
        let https = lookup_srv(&[addr], "_etcd-client-ssl._tcp.example.test").await;
        assert_eq!(
            https.unwrap_err(),
            format!("lookup _etcd-client-ssl._tcp.example.test on {addr}: no such host")
        );
        let http = lookup_srv(&[addr], "_etcd-client._tcp.example.test")
            .await
            .unwrap();
        assert_eq!(http[0].target, "localhost.");
    }
}
