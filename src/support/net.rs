//! A small IP network type (`10.0.0.0/26`, `fd00::/122`) with the exact text forms Go's
//! `net.IPNet.String()` produces, plus the arithmetic the allocator needs.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An address with a prefix length. The address is kept as given (not masked), so it can hold
/// both a network (`10.0.0.0/26`) and an interface address (`10.0.0.5/26`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix: u8,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid CIDR address: {0}")]
pub struct ParseIpNetError(pub String);

impl IpNet {
    pub fn new(addr: IpAddr, prefix: u8) -> Option<IpNet> {
        (prefix <= max_prefix(&addr)).then_some(IpNet { addr, prefix })
    }

    /// A host network: /32 for IPv4, /128 for IPv6.
    pub fn host(addr: IpAddr) -> IpNet {
        IpNet {
            addr,
            prefix: max_prefix(&addr),
        }
    }

    pub fn is_ipv4(&self) -> bool {
        self.addr.is_ipv4()
    }

    /// 4 or 6.
    pub fn version(&self) -> u8 {
        if self.is_ipv4() {
            4
        } else {
            6
        }
    }

    /// Number of address bits (32 or 128).
    pub fn bits(&self) -> u8 {
        max_prefix(&self.addr)
    }

    /// The network address (host bits cleared) with the same prefix.
    pub fn masked(&self) -> IpNet {
        let bits = self.bits();
        let v = to_u128(self.addr) & prefix_mask(self.prefix, bits);
        IpNet {
            addr: from_u128(v, self.is_ipv4()),
            prefix: self.prefix,
        }
    }

    /// Whether `ip` lies inside this network.
    pub fn contains(&self, ip: &IpAddr) -> bool {
        if ip.is_ipv4() != self.is_ipv4() {
            return false;
        }
        let m = prefix_mask(self.prefix, self.bits());
        to_u128(*ip) & m == to_u128(self.addr) & m
    }

    /// Whether `other` lies entirely inside this network.
    pub fn covers(&self, other: &IpNet) -> bool {
        other.is_ipv4() == self.is_ipv4()
            && other.prefix >= self.prefix
            && self.contains(&other.addr)
    }

    /// Number of addresses in the network (saturating at u128::MAX for an IPv6 /0).
    pub fn num_addresses(&self) -> u128 {
        let host_bits = u32::from(self.bits() - self.prefix);
        1u128.checked_shl(host_bits).unwrap_or(u128::MAX)
    }

    /// The address `n` places after the network address.
    pub fn nth(&self, n: u128) -> IpAddr {
        from_u128(to_u128(self.masked().addr).wrapping_add(n), self.is_ipv4())
    }

    /// The ordinal of `ip` inside this network (its offset from the network address).
    pub fn offset_of(&self, ip: &IpAddr) -> Option<u128> {
        self.contains(ip)
            .then(|| to_u128(*ip) - to_u128(self.masked().addr))
    }
}

fn max_prefix(addr: &IpAddr) -> u8 {
    if addr.is_ipv4() {
        32
    } else {
        128
    }
}

fn prefix_mask(prefix: u8, bits: u8) -> u128 {
    if prefix == 0 {
        return 0;
    }
    let all = if bits == 32 {
        u128::from(u32::MAX)
    } else {
        u128::MAX
    };
    // A full-length prefix (/32 on the v4 mask, /128) shifts everything out.
    all & !all.checked_shr(u32::from(prefix)).unwrap_or(0)
}

pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => u128::from(u32::from(a)),
        IpAddr::V6(a) => u128::from(a),
    }
}

pub fn from_u128(v: u128, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::from(v as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(v))
    }
}

impl fmt::Display for IpNet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl FromStr for IpNet {
    type Err = ParseIpNetError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseIpNetError(s.to_string());
        let (a, p) = s.split_once('/').ok_or_else(err)?;
        let addr: IpAddr = a.parse().map_err(|_| err())?;
        if p.is_empty() || p.len() > 3 || !p.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err());
        }
        let prefix: u8 = p.parse().map_err(|_| err())?;
        IpNet::new(addr, prefix).ok_or_else(err)
    }
}

impl Serialize for IpNet {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for IpNet {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Formats a MAC address the way Go's `net.HardwareAddr.String()` does.
pub fn format_mac(mac: &[u8]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_format() {
        let n: IpNet = "10.244.166.130/26".parse().unwrap();
        assert_eq!(n.masked().to_string(), "10.244.166.128/26");
        assert_eq!(n.num_addresses(), 64);
        let v6: IpNet = "fd00:10:244:0:c11:b42f:f17e:a680/122".parse().unwrap();
        assert_eq!(v6.to_string(), "fd00:10:244:0:c11:b42f:f17e:a680/122");
        assert!("10.0.0.0/33".parse::<IpNet>().is_err());
        assert!("10.0.0.0".parse::<IpNet>().is_err());
        assert!("pool-name".parse::<IpNet>().is_err());
    }

    #[test]
    fn containment_and_offsets() {
        let b: IpNet = "10.0.0.64/26".parse().unwrap();
        let ip: IpAddr = "10.0.0.70".parse().unwrap();
        assert!(b.contains(&ip));
        assert_eq!(b.offset_of(&ip), Some(6));
        assert_eq!(b.nth(6), ip);
        let pool: IpNet = "10.0.0.0/16".parse().unwrap();
        assert!(pool.covers(&b));
        assert!(!b.covers(&pool));
        assert_eq!(IpNet::host(ip).to_string(), "10.0.0.70/32");
        assert_eq!(format_mac(&[0xee; 6]), "ee:ee:ee:ee:ee:ee");
    }

    #[test]
    fn full_length_prefixes_mask_nothing_away() {
        // A /128 once shifted by 128 (a panic in debug builds, `::/128` in release ones).
        let h: IpNet = "fd00::5/128".parse().unwrap();
        assert_eq!(h.masked(), h);
        assert!(h.contains(&"fd00::5".parse().unwrap()));
        let v4: IpNet = "10.1.2.3/32".parse().unwrap();
        assert_eq!(v4.masked(), v4);
    }
}
