//! How Calico names its custom resources (libcalico-go `names.CIDRToName`, the BlockAffinity
//! name and labels of `ipam_affinity_v1.go` / `model.EnsureBlockAffinityLabels`).

use sha2::{Digest, Sha256};
use sha3::Sha3_256;

use crate::support::net::IpNet;

pub const LABEL_HOSTNAME_HASH: &str = "projectcalico.org/hostname-hash";
pub const LABEL_AFFINITY_TYPE: &str = "projectcalico.org/affinity-type";
pub const LABEL_IP_VERSION: &str = "projectcalico.org/ip-version";

/// `10.244.166.128/26` → `10-244-166-128-26`, `fd00::/122` → `fd00---122`.
pub fn cidr_to_name(cidr: &IpNet) -> String {
    cidr.to_string()
        .replacen('.', "-", 3)
        .replacen(':', "-", 7)
        .replacen('/', "-", 1)
}

/// `<host>-<cidr name>`; a name of 253 characters or more is cut and made unique with a
/// hash: `host[..252-len(c)-13]-<c>-<sha256("<host>+<c>")[..11]>`.
pub fn affinity_name(host: &str, cidr: &IpNet) -> String {
    let c = cidr_to_name(cidr);
    let name = format!("{host}-{c}");
    if name.len() < 253 {
        return name;
    }
    let keep = 252usize.saturating_sub(c.len() + 13);
    let cut = host.get(..keep).unwrap_or(host);
    let hash = hex::encode(Sha256::digest(format!("{host}+{c}").as_bytes()));
    format!("{cut}-{c}-{}", &hash[..11])
}

/// Base32 (RFC 4648 alphabet, no padding) of SHA3-256(hostname): 52 characters that fit a
/// label value.
pub fn hostname_hash(host: &str) -> String {
    base32_nopad(&Sha3_256::digest(host.as_bytes()))
}

fn base32_nopad(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    let (mut buf, mut bits) = (0u32, 0u32);
    for &b in data {
        buf = (buf << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buf >> bits) & 31) as usize] as char);
        }
    }
    if bits > 0 {
        out.push(ALPHABET[((buf << (5 - bits)) & 31) as usize] as char);
    }
    out
}

/// The three labels every BlockAffinity carries (host lookups select on them).
pub fn affinity_labels(
    host: &str,
    affinity_type: &str,
    cidr: &IpNet,
) -> [(&'static str, String); 3] {
    let version = if cidr.to_string().contains(':') {
        "6"
    } else {
        "4"
    };
    [
        (LABEL_AFFINITY_TYPE, affinity_type.to_string()),
        (LABEL_HOSTNAME_HASH, hostname_hash(host)),
        (LABEL_IP_VERSION, version.to_string()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        let v4: IpNet = "10.244.166.128/26".parse().unwrap();
        let v6: IpNet = "fd00::/122".parse().unwrap();
        assert_eq!(cidr_to_name(&v4), "10-244-166-128-26");
        assert_eq!(cidr_to_name(&v6), "fd00---122");
        assert_eq!(affinity_name("node1", &v4), "node1-10-244-166-128-26");
        let long = "a".repeat(260);
        let n = affinity_name(&long, &v4);
        assert_eq!(n.len(), 252);
        assert!(n.starts_with(&"a".repeat(222)));
        assert!(n.contains("-10-244-166-128-26-"));
    }

    #[test]
    fn hostname_hash_matches_upstream() {
        assert_eq!(
            hostname_hash("node1"),
            "7DS2CCNJGGLTHBDQLLFO6SX24SY2YDDEG3W2VN556FA2W4DLLV5A"
        );
    }
}
