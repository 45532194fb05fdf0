//! Waiting for one link of the calling thread's netns to be removed, by its RTM_DELLINK
//! notification. DEL uses it for the host-side veth: the kernel sends that notification once
//! the device is closed and unlisted, after the routes through it were flushed (NETDEV_DOWN
//! and NETDEV_UNREGISTER come first), but 10–60 ms before the RTM_DELLINK request itself
//! returns (the rest is the kernel's RCU waits and reference draining). So the pod's
//! addresses can be released while the kernel finishes: no host route to them is left.

use netlink_packet_route::link::LinkAttribute;
use netlink_packet_route::RouteNetlinkMessage;
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload};
use rtnetlink::sys::{protocols::NETLINK_ROUTE, AsyncSocket, AsyncSocketExt, TokioSocket};

/// A subscription to the link notifications of the netns it was made in, for one name.
pub struct LinkGoneWatch {
    socket: TokioSocket,
    name: String,
}

impl LinkGoneWatch {
    /// Subscribes to link notifications; must be made before the removal starts (one that
    /// happened before is never seen). Needs the caller's tokio runtime.
    pub fn subscribe(name: &str) -> std::io::Result<LinkGoneWatch> {
        let mut socket = TokioSocket::new(NETLINK_ROUTE)?;
        socket.socket_mut().bind_auto()?;
        let group = libc::RTNLGRP_LINK;
        socket.socket_mut().add_membership(group)?;
        Ok(LinkGoneWatch {
            socket,
            name: name.to_string(),
        })
    }

    /// Resolves when the link's RTM_DELLINK arrives. Never resolves when it does not (the
    /// link did not exist, or notifications were lost because the socket overflowed): the
    /// caller races it with the removal itself.
    pub async fn gone(self) {
        loop {
            let data = match self.socket.recv_from_full().await {
                Ok((data, _)) => data,
                Err(e) => {
                    tracing::debug!(error = %e, "link notifications lost; waiting for the removal itself");
                    return std::future::pending().await;
                }
            };
            if names_deleted_link(&data, &self.name) {
                return;
            }
        }
    }
}

/// Whether `data` (one datagram of netlink messages) holds an RTM_DELLINK for `name`.
fn names_deleted_link(data: &[u8], name: &str) -> bool {
    let mut rest = data;
    while !rest.is_empty() {
        let Ok(msg) = NetlinkMessage::<RouteNetlinkMessage>::deserialize(rest) else {
            return false;
        };
        let len = (msg.header.length as usize).next_multiple_of(4);
        if let NetlinkPayload::InnerMessage(RouteNetlinkMessage::DelLink(link)) = &msg.payload {
            let named = link
                .attributes
                .iter()
                .any(|a| matches!(a, LinkAttribute::IfName(n) if n == name));
            if named {
                return true;
            }
        }
        if len == 0 || len >= rest.len() {
            return false;
        }
        rest = &rest[len..];
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use netlink_packet_route::link::LinkMessage;

    fn datagram(msgs: Vec<RouteNetlinkMessage>) -> Vec<u8> {
        let mut out = Vec::new();
        for m in msgs {
            let mut nl = NetlinkMessage::from(m);
            nl.finalize();
            let mut buf = vec![0; nl.buffer_len()];
            nl.serialize(&mut buf);
            buf.resize(buf.len().next_multiple_of(4), 0);
            out.extend(buf);
        }
        out
    }

    fn link(name: &str) -> LinkMessage {
        let mut l = LinkMessage::default();
        l.attributes.push(LinkAttribute::IfName(name.into()));
        l
    }

    #[test]
    fn only_the_named_links_removal_counts() {
        let other = datagram(vec![RouteNetlinkMessage::DelLink(link("cali0000"))]);
        assert!(!names_deleted_link(&other, "cali1234"));
        let added = datagram(vec![RouteNetlinkMessage::NewLink(link("cali1234"))]);
        assert!(!names_deleted_link(&added, "cali1234"));
        let second = datagram(vec![
            RouteNetlinkMessage::NewLink(link("cali1234")),
            RouteNetlinkMessage::DelLink(link("cali1234")),
        ]);
        assert!(names_deleted_link(&second, "cali1234"));
        assert!(!names_deleted_link(&[1, 2, 3], "cali1234"));
    }
}
