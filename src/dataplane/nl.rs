//! Thin rtnetlink wrappers: link lookup/set, address and route dumps, and route messages built
//! the way Go's vishvananda/netlink builds them (protocol `boot`, main table, unicast); and
//! one blocking link deletion (`del_link_blocking`) for threads that have no runtime.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{LinkAttribute, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage, RouteProtocol, RouteScope,
};
use netlink_packet_route::AddressFamily;
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

use super::{DelLinkError, LookupError};
use crate::support::gocompat::errno_text;
use crate::support::net::IpNet;

/// The errno carried by a netlink error reply, as a positive number.
pub(crate) fn nl_errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get().abs()),
        _ => None,
    }
}

/// Go's rendering of a netlink failure: the bare errno text (`file exists`).
pub(crate) fn nl_text(e: &rtnetlink::Error) -> String {
    match nl_errno(e) {
        Some(code) => errno_text(code),
        None => e.to_string(),
    }
}

/// Looks a link up by name; `Ok(None)` when the kernel says ENODEV.
pub(crate) async fn link_by_name(
    h: &Handle,
    name: &str,
) -> Result<Option<LinkMessage>, rtnetlink::Error> {
    let mut s = h.link().get().match_name(name.to_string()).execute();
    match s.try_next().await {
        Ok(m) => Ok(m),
        Err(e) if nl_errno(&e) == Some(libc::ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Looks a link up by name; its failures render as Go's (`Link not found` / errno text).
pub(crate) async fn lookup(h: &Handle, name: &str) -> Result<LinkMessage, LookupError> {
    match link_by_name(h, name).await {
        Ok(Some(m)) => Ok(m),
        Ok(None) => Err(LookupError::NotFound),
        Err(e) => Err(LookupError::Netlink(e)),
    }
}

/// Looks a link up by index (used only to name the owner of a conflicting route).
pub(crate) async fn link_name_by_index(h: &Handle, index: u32) -> Option<String> {
    let mut s = h.link().get().match_index(index).execute();
    match s.try_next().await {
        Ok(Some(m)) => link_name(&m),
        _ => None,
    }
}

pub(crate) fn link_name(m: &LinkMessage) -> Option<String> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.clone()),
        _ => None,
    })
}

pub(crate) fn link_mac(m: &LinkMessage) -> Option<Vec<u8>> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Address(b) => Some(b.clone()),
        _ => None,
    })
}

pub(crate) async fn set_mac(h: &Handle, index: u32, mac: &[u8]) -> Result<(), rtnetlink::Error> {
    h.link()
        .set(
            LinkUnspec::new_with_index(index)
                .address(mac.to_vec())
                .build(),
        )
        .execute()
        .await
}

pub(crate) async fn set_up(h: &Handle, index: u32) -> Result<(), rtnetlink::Error> {
    h.link()
        .set(LinkUnspec::new_with_index(index).up().build())
        .execute()
        .await
}

pub(crate) async fn set_down(h: &Handle, index: u32) -> Result<(), rtnetlink::Error> {
    h.link()
        .set(LinkUnspec::new_with_index(index).down().build())
        .execute()
        .await
}

/// Deletes a link on a blocking netlink socket of the calling thread's netns, by `index`
/// or, when it is 0, by `name`: one RTM_DELLINK and its answer, no runtime. The kernel does
/// the whole teardown before it answers. `Ok(false)`: there is no such link.
pub(crate) fn del_link_blocking(name: &str, index: u32) -> Result<bool, DelLinkError> {
    use netlink_packet_route::RouteNetlinkMessage;
    use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
    use rtnetlink::sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

    let mut socket = Socket::new(NETLINK_ROUTE).map_err(DelLinkError::Socket)?;
    socket.bind_auto().map_err(DelLinkError::Socket)?;
    socket
        .connect(&SocketAddr::new(0, 0))
        .map_err(DelLinkError::Socket)?;

    let mut link = LinkMessage::default();
    link.header.index = index;
    if index == 0 {
        link.attributes
            .push(LinkAttribute::IfName(name.to_string()));
    }
    let mut req = NetlinkMessage::from(RouteNetlinkMessage::DelLink(link));
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
    req.header.sequence_number = 1;
    req.finalize();
    let mut buf = vec![0; req.buffer_len()];
    req.serialize(&mut buf);
    socket.send(&buf, 0).map_err(DelLinkError::Socket)?;
    loop {
        let (data, _) = socket.recv_from_full().map_err(DelLinkError::Socket)?;
        let mut rest = &data[..];
        while !rest.is_empty() {
            let msg = NetlinkMessage::<RouteNetlinkMessage>::deserialize(rest)
                .map_err(DelLinkError::Decode)?;
            let len = (msg.header.length as usize).next_multiple_of(4);
            if let NetlinkPayload::Error(e) = msg.payload {
                return match e.code.map(|c| nix::errno::Errno::from_raw(c.get().abs())) {
                    None => Ok(true),
                    Some(nix::errno::Errno::ENODEV) => Ok(false),
                    Some(errno) => Err(DelLinkError::Kernel(errno)),
                };
            }
            if len == 0 || len >= rest.len() {
                break;
            }
            rest = &rest[len..];
        }
    }
}

/// The IPv6 addresses on a link, in kernel dump order.
pub(crate) async fn ipv6_addresses(
    h: &Handle,
    index: u32,
) -> Result<Vec<Ipv6Addr>, rtnetlink::Error> {
    let mut req = h.address().get().set_link_index_filter(index);
    req.message_mut().header.family = AddressFamily::Inet6;
    let msgs: Vec<_> = req.execute().try_collect().await?;
    Ok(msgs
        .iter()
        .filter(|m| m.header.index == index)
        .filter_map(|m| {
            m.attributes.iter().find_map(|a| match a {
                AddressAttribute::Address(IpAddr::V6(ip)) => Some(*ip),
                _ => None,
            })
        })
        .collect())
}

/// A route message as Go's netlink `RouteAdd` sends it: main table, unicast, protocol `boot`.
pub(crate) fn route_message(
    dst: IpNet,
    gateway: Option<IpAddr>,
    oif: u32,
    scope: RouteScope,
) -> RouteMessage {
    match dst.addr {
        IpAddr::V4(a) => {
            let mut b = RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(a, dst.prefix);
            if let Some(IpAddr::V4(gw)) = gateway {
                b = b.gateway(gw);
            }
            b.output_interface(oif)
                .scope(scope)
                .protocol(RouteProtocol::Boot)
                .build()
        }
        IpAddr::V6(a) => {
            let mut b = RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(a, dst.prefix);
            if let Some(IpAddr::V6(gw)) = gateway {
                b = b.gateway(gw);
            }
            b.output_interface(oif)
                .scope(scope)
                .protocol(RouteProtocol::Boot)
                .build()
        }
    }
}

/// The fields of a dumped route that the host-route conflict check looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RouteInfo {
    /// Output interface (0 when absent, e.g. multipath).
    pub oif: u32,
    /// Destination; `None` for a default route (netlink reports no RTA_DST).
    pub dst: Option<IpNet>,
    pub scope: RouteScope,
}

/// Dumps the main-table routes of one family, skipping cloned (cache) entries, like
/// vishvananda/netlink's `RouteList` without a table filter.
pub(crate) async fn main_table_routes(
    h: &Handle,
    v4: bool,
) -> Result<Vec<RouteInfo>, rtnetlink::Error> {
    let req = if v4 {
        RouteMessageBuilder::<Ipv4Addr>::new().build()
    } else {
        RouteMessageBuilder::<Ipv6Addr>::new().build()
    };
    let msgs: Vec<RouteMessage> = h.route().get(req).execute().try_collect().await?;
    Ok(msgs.iter().filter_map(route_info).collect())
}

fn route_info(m: &RouteMessage) -> Option<RouteInfo> {
    if m.header.flags.contains(RouteFlags::Cloned) {
        return None;
    }
    let mut table = u32::from(m.header.table);
    let mut oif = 0;
    let mut dst = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Table(t) => table = *t,
            RouteAttribute::Oif(i) => oif = *i,
            RouteAttribute::Destination(RouteAddress::Inet(ip)) => {
                dst = IpNet::new(IpAddr::V4(*ip), m.header.destination_prefix_length)
            }
            RouteAttribute::Destination(RouteAddress::Inet6(ip)) => {
                dst = IpNet::new(IpAddr::V6(*ip), m.header.destination_prefix_length)
            }
            _ => {}
        }
    }
    if table != u32::from(RouteHeader::RT_TABLE_MAIN) {
        return None;
    }
    Some(RouteInfo {
        oif,
        dst,
        scope: m.header.scope,
    })
}

/// Go's `netlink.Scope.String()`.
pub(crate) fn scope_name(s: RouteScope) -> &'static str {
    match s {
        RouteScope::Universe => "universe",
        RouteScope::Site => "site",
        RouteScope::Link => "link",
        RouteScope::Host => "host",
        RouteScope::NoWhere => "nowhere",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_names() {
        assert_eq!(scope_name(RouteScope::Link), "link");
        assert_eq!(scope_name(RouteScope::Universe), "universe");
        assert_eq!(scope_name(RouteScope::Other(7)), "unknown");
    }

    #[test]
    fn route_messages_use_proto_boot_and_main_table() {
        let m = route_message("10.65.0.5/32".parse().unwrap(), None, 7, RouteScope::Link);
        assert_eq!(m.header.protocol, RouteProtocol::Boot);
        assert_eq!(m.header.table, RouteHeader::RT_TABLE_MAIN);
        assert_eq!(m.header.scope, RouteScope::Link);
        assert_eq!(m.header.destination_prefix_length, 32);
        assert!(m.attributes.contains(&RouteAttribute::Oif(7)));
        let info = route_info(&m).unwrap();
        assert_eq!(info.dst, Some("10.65.0.5/32".parse().unwrap()));
        assert_eq!(info.oif, 7);

        let gw: IpAddr = "fe80::ecee:eeff:feee:eeee".parse().unwrap();
        let m = route_message("::/0".parse().unwrap(), Some(gw), 3, RouteScope::Universe);
        assert!(m
            .attributes
            .contains(&RouteAttribute::Gateway(RouteAddress::Inet6(
                "fe80::ecee:eeff:feee:eeee".parse().unwrap()
            ))));
    }
}
