//! CHECK's look at the kernel: does the pod's interface, the host side of its veth pair and
//! the host routes still match what ADD made? Read-only; the first mismatch is the answer.
//!
//! Pod side (inside the pod netns): the interface exists, is a veth, has the result's MAC and
//! MTU and every result address (/32, /128), the IPv4 gateway route to 169.254.1.1 and each
//! pod route via 169.254.1.1 (IPv4) or the host side's link-local address (IPv6).
//! Host side (the caller's netns): the host veth exists, is a veth, is up, has MAC
//! ee:ee:ee:ee:ee:ee and the sysctls ADD wrote, and each address has its /32 (/128) route
//! through it.

use std::net::IpAddr;

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo, LinkMessage};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteHeader, RouteMessage};
use rtnetlink::{Handle, RouteMessageBuilder};

use super::netns::{Netns, OpenError};
use super::nl::{link_mac, lookup};
use super::sys::open_netns;
use super::{DataplaneError, Families, HOST_SIDE_LL, HOST_SIDE_MAC, IPV4_GATEWAY};
use crate::support::net::{format_mac, IpNet};

/// What ADD made, as the previous result and the config describe it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Expected {
    pub netns_path: String,
    pub ifname: String,
    pub host_veth: String,
    /// Lower-case `aa:bb:..`; `None` when the result did not record it.
    pub container_mac: Option<String>,
    /// 0 = not recorded.
    pub mtu: u32,
    pub ips: Vec<IpAddr>,
    /// Pod route destinations (e.g. `0.0.0.0/0`), for families that have an address.
    pub routes: Vec<IpNet>,
    /// False for KubeVirt migration targets, whose host routes someone else owns.
    pub host_routes: bool,
}

impl Expected {
    /// Whether the result has IPv4 and IPv6 addresses.
    fn families(&self) -> (bool, bool) {
        (
            self.ips.iter().any(IpAddr::is_ipv4),
            self.ips.iter().any(IpAddr::is_ipv6),
        )
    }
}

type Result<T, E = DataplaneError> = std::result::Result<T, E>;

fn mismatch(msg: impl Into<String>) -> DataplaneError {
    DataplaneError::Check(msg.into())
}

/// Compares the kernel with `e`; `DataplaneError::Check` names the first difference. Runs
/// on the call's runtime (the pod side through the call's pod handle, `netns.rs`), from a
/// thread in the host netns.
pub async fn verify(e: &Expected) -> Result<()> {
    let pod_ns = open_netns(&e.netns_path).map_err(|err| match err.is_not_exist() {
        true => mismatch(format!("netns {} does not exist", e.netns_path)),
        false => DataplaneError::EnterNetns(err),
    })?;
    let ns = Netns::open(&e.netns_path, pod_ns, Families::default())
        .await
        .map_err(|err| match err {
            OpenError::Host(m) => DataplaneError::HostHandle(m),
            OpenError::Enter(m) => DataplaneError::EnterNetns(m),
            OpenError::Pod(m) => DataplaneError::Thread(m),
        })?;
    pod_side(&ns.pod, e).await?;
    host_side(&ns.host, e).await
}

async fn pod_side(h: &Handle, e: &Expected) -> Result<()> {
    let link = lookup(h, &e.ifname)
        .await
        .map_err(|source| DataplaneError::CheckLink {
            what: format!(
                "container interface {:?} in netns {}",
                e.ifname, e.netns_path
            ),
            source,
        })?;
    is_veth(&link, &e.ifname)?;
    let index = link.header.index;
    if let Some(want) = &e.container_mac {
        let got = link_mac(&link).map(|m| format_mac(&m)).unwrap_or_default();
        if !got.eq_ignore_ascii_case(want) {
            return Err(mismatch(format!(
                "container interface {:?} has MAC {got}, the result says {want}",
                e.ifname
            )));
        }
    }
    if e.mtu != 0 {
        let got = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::Mtu(m) => Some(*m),
            _ => None,
        });
        if got != Some(e.mtu) {
            return Err(mismatch(format!(
                "container interface {:?} has MTU {}, the result says {}",
                e.ifname,
                got.unwrap_or_default(),
                e.mtu
            )));
        }
    }
    let addrs = addresses(h, index).await?;
    for ip in &e.ips {
        let want = IpNet::host(*ip);
        if !addrs.contains(&want) {
            return Err(mismatch(format!(
                "container interface {:?} lacks address {want}",
                e.ifname
            )));
        }
    }
    let (has_v4, has_v6) = e.families();
    let (v4_routes, v6_routes) = routes_of_families(h, has_v4, has_v6).await?;
    if has_v4 {
        let gw = IpNet::host(IpAddr::V4(IPV4_GATEWAY));
        if !v4_routes.iter().any(|r| r.oif == index && r.dst == gw) {
            return Err(mismatch(format!(
                "no route to the gateway {} on {:?} in the container",
                IPV4_GATEWAY, e.ifname
            )));
        }
    }
    for dst in &e.routes {
        let (table, gw, family_present) = if dst.addr.is_ipv4() {
            (&v4_routes, IpAddr::V4(IPV4_GATEWAY), has_v4)
        } else {
            (&v6_routes, IpAddr::V6(HOST_SIDE_LL), has_v6)
        };
        if !family_present {
            continue;
        }
        let found = table
            .iter()
            .any(|r| r.oif == index && r.dst == *dst && r.gateway == Some(gw));
        if !found {
            return Err(mismatch(format!(
                "container route {dst} via {gw} dev {} is missing",
                e.ifname
            )));
        }
    }
    Ok(())
}

async fn host_side(h: &Handle, e: &Expected) -> Result<()> {
    let hv = e.host_veth.as_str();
    let link = lookup(h, hv)
        .await
        .map_err(|source| DataplaneError::CheckLink {
            what: format!("host veth {hv:?}"),
            source,
        })?;
    is_veth(&link, hv)?;
    let mac = link_mac(&link).unwrap_or_default();
    if mac != HOST_SIDE_MAC {
        return Err(mismatch(format!(
            "host veth {hv:?} has MAC {}, not ee:ee:ee:ee:ee:ee",
            format_mac(&mac)
        )));
    }
    if !link.header.flags.contains(LinkFlags::Up) {
        return Err(mismatch(format!("host veth {hv:?} is down")));
    }
    let (has_v4, has_v6) = e.families();
    let mut sysctls = Vec::new();
    if has_v4 {
        sysctls.extend([
            ("ipv4", "conf", "proxy_arp", "1"),
            ("ipv4", "conf", "forwarding", "1"),
            ("ipv4", "conf", "route_localnet", "1"),
        ]);
    }
    if has_v6 {
        sysctls.extend([
            ("ipv6", "conf", "proxy_ndp", "1"),
            ("ipv6", "conf", "forwarding", "1"),
        ]);
    }
    for (family, kind, key, want) in sysctls {
        let path = format!("/proc/sys/net/{family}/{kind}/{hv}/{key}");
        let got = std::fs::read_to_string(&path).unwrap_or_default();
        if got.trim() != want {
            return Err(mismatch(format!(
                "net.{family}.{kind}.{hv}.{key} is {:?}, not {want}",
                got.trim()
            )));
        }
    }
    if !e.host_routes {
        return Ok(());
    }
    let index = link.header.index;
    let (v4, v6) = routes_of_families(h, has_v4, has_v6).await?;
    for ip in &e.ips {
        let dst = IpNet::host(*ip);
        let table = if ip.is_ipv4() { &v4 } else { &v6 };
        if !table.iter().any(|r| r.dst == dst && r.oif == index) {
            return Err(mismatch(format!("host route {dst} dev {hv} is missing")));
        }
    }
    Ok(())
}

fn is_veth(link: &LinkMessage, name: &str) -> Result<()> {
    let veth = link.attributes.iter().any(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos
            .iter()
            .any(|i| matches!(i, LinkInfo::Kind(InfoKind::Veth))),
        _ => false,
    });
    if veth {
        Ok(())
    } else {
        Err(mismatch(format!("interface {name:?} is not a veth")))
    }
}

/// The addresses on a link, with their prefix lengths.
async fn addresses(h: &Handle, index: u32) -> Result<Vec<IpNet>> {
    let msgs: Vec<_> = h
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(|source| DataplaneError::Dump {
            what: "listing addresses",
            source,
        })?;
    Ok(msgs
        .iter()
        .filter(|m| m.header.index == index)
        .filter_map(|m| {
            m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(ip) => IpNet::new(*ip, m.header.prefix_len),
                _ => None,
            })
        })
        .collect())
}

/// One main-table route: destination (0/0 for a default route), gateway, output interface.
struct Route {
    dst: IpNet,
    gateway: Option<IpAddr>,
    oif: u32,
}

/// The main-table routes of the families asked for (an empty list for the others).
async fn routes_of_families(h: &Handle, v4: bool, v6: bool) -> Result<(Vec<Route>, Vec<Route>)> {
    let v4 = if v4 {
        routes(h, true).await?
    } else {
        Vec::new()
    };
    let v6 = if v6 {
        routes(h, false).await?
    } else {
        Vec::new()
    };
    Ok((v4, v6))
}

async fn routes(h: &Handle, v4: bool) -> Result<Vec<Route>> {
    let req = if v4 {
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
    } else {
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
    };
    let msgs: Vec<RouteMessage> =
        h.route()
            .get(req)
            .execute()
            .try_collect()
            .await
            .map_err(|source| DataplaneError::Dump {
                what: "listing routes",
                source,
            })?;
    Ok(msgs.iter().filter_map(|m| route(m, v4)).collect())
}

fn route(m: &RouteMessage, v4: bool) -> Option<Route> {
    let mut table = u32::from(m.header.table);
    let (mut dst, mut gateway, mut oif) = (None, None, 0);
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Oif(i) => oif = *i,
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => dst = Some(IpAddr::V4(*ip)),
            RouteAttribute::Destination(RouteAddress::Inet6(ip)) => dst = Some(IpAddr::V6(*ip)),
            RouteAttribute::Gateway(RouteAddress::Inet(ip)) => gateway = Some(IpAddr::V4(*ip)),
            RouteAttribute::Gateway(RouteAddress::Inet6(ip)) => gateway = Some(IpAddr::V6(*ip)),
            _ => {}
        }
    }
    if table != u32::from(RouteHeader::RT_TABLE_MAIN) {
        return None;
    }
    let unspecified = if v4 {
        IpAddr::from([0u8; 4])
    } else {
        IpAddr::from([0u16; 8])
    };
    let dst = IpNet::new(
        dst.unwrap_or(unspecified),
        m.header.destination_prefix_length,
    )?;
    Some(Route { dst, gateway, oif })
}
