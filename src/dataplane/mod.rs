//! The Linux dataplane: veth pair, MACs, addresses, routes and sysctls inside and outside the
//! pod's network namespace (cni-plugin/pkg/dataplane/linux). Entry points: `do_networking`
//! (ADD) and `clean_up_namespace` (DEL). Blocking functions: every netlink step runs on a
//! short-lived thread inside the right namespace (see `netns`).

mod netns;
pub mod sysctl;

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use netlink_packet_route::address::AddressAttribute;
use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute, LinkMessage};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope,
};
use rtnetlink::{Handle, LinkUnspec, LinkVeth, RouteMessageBuilder};
use tracing::{debug, info, warn};

use crate::net::{format_mac, IpNet};

/// The pod's IPv4 gateway: a link-local next hop the host answers by proxy ARP.
pub const GATEWAY_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
/// The host end's IPv6 link-local address, derived from its MAC ee:ee:ee:ee:ee:ee.
pub const GATEWAY_V6: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0xecee, 0xeeff, 0xfeee, 0xeeee);
pub const HOST_MAC: [u8; 6] = [0xee; 6];

const ENODEV: i32 = -19;
const EEXIST: i32 = -17;
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(20);

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("failed to enter netns: {0}")]
    EnterNetns(String),
    #[error("{0}")]
    Netlink(String),
    #[error("error configuring sysctls for interface: {iface}, error: {error}")]
    HostSysctl { iface: String, error: String },
    #[error("error configuring sysctls for the container netns, error: {0}")]
    ContainerSysctl(String),
    #[error("timed out waiting for host-side interface {0:?} to accept MAC ee:ee:ee:ee:ee:ee")]
    MacTimeout(String),
    #[error("failed to get IPv6 addresses for host side of the pod interface")]
    NoHostIpv6,
    #[error("error adding host side routes for interface: {iface}, error: {error}")]
    HostRoute { iface: String, error: String },
    #[error("timed out deleting device in netns {0}")]
    CleanupTimeout(String),
    #[error("failed to clean up workload's pod interface inside netns: {0}")]
    Cleanup(String),
}

/// What to build for one pod interface.
#[derive(Clone, Debug, Default)]
pub struct NetworkingRequest {
    pub netns_path: String,
    pub ifname: String,
    pub host_veth: String,
    /// 0 = kernel default.
    pub mtu: u32,
    pub num_queues: u32,
    /// Container addresses (masks forced to /32 and /128).
    pub ips: Vec<IpNet>,
    /// Container route destinations, routed via the family's gateway.
    pub routes: Vec<IpNet>,
    pub allow_ip_forwarding: bool,
    pub container_mac: Option<[u8; 6]>,
    pub skip_host_routes: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkingResult {
    pub host_veth: String,
    /// Lower-case `aa:bb:cc:dd:ee:ff`.
    pub container_mac: String,
}

fn nl(context: &str, e: rtnetlink::Error) -> DataplaneError {
    DataplaneError::Netlink(format!("{context}: {e}"))
}

fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| c.get()),
        _ => None,
    }
}

/// The index of link `name`, or None when there is no such link.
async fn link_index(h: &Handle, name: &str) -> Result<Option<u32>, rtnetlink::Error> {
    match h
        .link()
        .get()
        .match_name(name.to_string())
        .execute()
        .try_next()
        .await
    {
        Ok(Some(m)) => Ok(Some(m.header.index)),
        Ok(None) => Ok(None),
        Err(e) if errno(&e) == Some(ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

async fn require_index(h: &Handle, name: &str) -> Result<u32, DataplaneError> {
    link_index(h, name)
        .await
        .map_err(|e| nl(&format!("failed to lookup {name:?}"), e))?
        .ok_or_else(|| {
            DataplaneError::Netlink(format!("failed to lookup {name:?}: Link not found"))
        })
}

fn link_mac(m: &LinkMessage) -> Option<Vec<u8>> {
    m.attributes.iter().find_map(|a| match a {
        LinkAttribute::Address(mac) => Some(mac.clone()),
        _ => None,
    })
}

async fn get_link(h: &Handle, index: u32) -> Result<LinkMessage, DataplaneError> {
    h.link()
        .get()
        .match_index(index)
        .execute()
        .try_next()
        .await
        .map_err(|e| nl("failed to read link", e))?
        .ok_or_else(|| DataplaneError::Netlink(format!("link {index} vanished")))
}

/// Whether a link of this name exists in the caller's network namespace.
pub fn host_link_exists(name: &str) -> Result<bool, DataplaneError> {
    let name = name.to_string();
    netns::run_in(None, |h| async move {
        Ok(link_index(&h, &name)
            .await
            .map_err(|e| nl("failed to list links", e))?
            .is_some())
    })
}

fn open_netns(path: &str) -> Result<File, DataplaneError> {
    File::open(path).map_err(|e| DataplaneError::EnterNetns(format!("{path}: {e}")))
}

/// Builds the pod's interface (calico-cni-behavior.md §2.4): the veth pair with the host end
/// in the caller's netns, MACs, sysctls, gateway routes, addresses and host routes.
pub fn do_networking(req: &NetworkingRequest) -> Result<NetworkingResult, DataplaneError> {
    let started = Instant::now();
    let host_ns = netns::current()?;
    let pod_ns = open_netns(&req.netns_path)?;
    let ips: Vec<IpNet> = req.ips.iter().map(|ip| IpNet::host(ip.addr)).collect();
    let has_v4 = ips.iter().any(IpNet::is_ipv4);
    let has_v6 = ips.iter().any(|i| !i.is_ipv4());
    let host_veth = req.host_veth.as_str();
    let ips = &ips;

    // 1. A stale host link with our name (e.g. from a crashed ADD) goes first.
    netns::run_in(None, |h| async move {
        if let Some(idx) = link_index(&h, host_veth)
            .await
            .map_err(|e| nl("failed to list links", e))?
        {
            info!(host_veth, "deleting pre-existing host link");
            h.link()
                .del(idx)
                .execute()
                .await
                .map_err(|e| nl("failed to delete stale host link", e))?;
        }
        Ok(())
    })?;

    // 2. In the pod netns: the veth pair, its peer created straight in the host netns.
    let host_fd = std::os::fd::AsRawFd::as_raw_fd(&host_ns);
    let queues = req.num_queues.max(1);
    netns::run_in(Some(&pod_ns), |h| async move {
        let mut peer = LinkUnspec::new_with_name(host_veth)
            .append_extra_attribute(LinkAttribute::NumTxQueues(queues))
            .append_extra_attribute(LinkAttribute::NumRxQueues(queues))
            .append_extra_attribute(LinkAttribute::NetNsFd(host_fd));
        let mut veth = LinkVeth::new(&req.ifname, host_veth)
            .append_extra_attribute(LinkAttribute::NumTxQueues(queues))
            .append_extra_attribute(LinkAttribute::NumRxQueues(queues));
        if req.mtu > 0 {
            peer = peer.mtu(req.mtu);
            veth = veth.mtu(req.mtu);
        }
        let msg = veth
            .set_info_data(InfoData::Veth(InfoVeth::Peer(peer.build())))
            .build();
        h.link().add(msg).execute().await.map_err(|e| {
            nl(
                &format!("failed to create veth pair {:?}/{host_veth:?}", req.ifname),
                e,
            )
        })
    })?;
    drop(host_ns);

    // 3-7 (host side): MAC ee:ee:ee:ee:ee:ee, sysctls, up.
    let host_index = netns::run_in(None, |h| async move {
        let idx = require_index(&h, host_veth).await?;
        set_host_mac(&h, idx, host_veth).await?;
        host_sysctls(host_veth, has_v4, has_v6).map_err(|error| DataplaneError::HostSysctl {
            iface: host_veth.to_string(),
            error,
        })?;
        h.link()
            .set(LinkUnspec::new_with_index(idx).up().build())
            .execute()
            .await
            .map_err(|e| nl(&format!("failed to set {host_veth:?} up"), e))?;
        Ok(idx)
    })?;

    // 5, 7-12 (pod side): DAD off, up, MAC, gateway routes, addresses, sysctls.
    let container_mac = netns::run_in(Some(&pod_ns), |h| async move {
        let ifname = req.ifname.as_str();
        if has_v6 {
            sysctl::set(&format!("/proc/sys/net/ipv6/conf/{ifname}/accept_dad"), "0")
                .map_err(DataplaneError::ContainerSysctl)?;
        }
        let idx = require_index(&h, ifname).await?;
        h.link()
            .set(LinkUnspec::new_with_index(idx).up().build())
            .execute()
            .await
            .map_err(|e| nl(&format!("failed to set {ifname:?} up"), e))?;
        if let Some(mac) = req.container_mac {
            h.link()
                .set(
                    LinkUnspec::new_with_index(idx)
                        .address(mac.to_vec())
                        .build(),
                )
                .execute()
                .await
                .map_err(|e| nl("failed to set the container MAC", e))?;
        }
        let mac = link_mac(&get_link(&h, idx).await?).unwrap_or_default();
        if has_v4 {
            add_route(
                &h,
                RouteMessageBuilder::<Ipv4Addr>::new()
                    .destination_prefix(GATEWAY_V4, 32)
                    .output_interface(idx)
                    .scope(RouteScope::Link)
                    .protocol(RouteProtocol::Boot)
                    .build(),
                "failed to add route inside the container",
            )
            .await?;
            for r in req.routes.iter().filter(|r| r.is_ipv4()) {
                let IpAddr::V4(dst) = r.masked().addr else {
                    continue;
                };
                add_route(
                    &h,
                    RouteMessageBuilder::<Ipv4Addr>::new()
                        .destination_prefix(dst, r.prefix)
                        .gateway(GATEWAY_V4)
                        .output_interface(idx)
                        .protocol(RouteProtocol::Boot)
                        .build(),
                    &format!("failed to add IPv4 route for {r} via {GATEWAY_V4}"),
                )
                .await?;
            }
        }
        if has_v6 {
            for p in ["all", "default", "lo"] {
                sysctl::set(&format!("/proc/sys/net/ipv6/conf/{p}/disable_ipv6"), "0")
                    .map_err(DataplaneError::ContainerSysctl)?;
            }
            for r in req.routes.iter().filter(|r| !r.is_ipv4()) {
                let IpAddr::V6(dst) = r.masked().addr else {
                    continue;
                };
                add_route(
                    &h,
                    RouteMessageBuilder::<Ipv6Addr>::new()
                        .destination_prefix(dst, r.prefix)
                        .gateway(GATEWAY_V6)
                        .output_interface(idx)
                        .protocol(RouteProtocol::Boot)
                        .build(),
                    &format!("failed to add IPv6 route for {r} via {GATEWAY_V6}"),
                )
                .await?;
            }
        }
        for ip in ips {
            h.address()
                .add(idx, ip.addr, ip.prefix)
                .execute()
                .await
                .map_err(|e| nl(&format!("failed to add IP addr to {ifname:?}"), e))?;
        }
        container_sysctls(has_v4, has_v6, req.allow_ip_forwarding)
            .map_err(DataplaneError::ContainerSysctl)?;
        Ok(format_mac(&mac))
    })?;

    // 10, 13 (host side): the host end's link-local address, then the /32 and /128 routes.
    netns::run_in(None, |h| async move {
        if has_v6 {
            wait_for_host_ipv6(&h, host_index).await?;
        }
        if !req.skip_host_routes {
            for ip in ips {
                add_host_route(&h, host_index, host_veth, ip)
                    .await
                    .map_err(|error| DataplaneError::HostRoute {
                        iface: host_veth.to_string(),
                        error,
                    })?;
            }
        }
        Ok(())
    })?;
    debug!(elapsed = ?started.elapsed(), "networked namespace");
    Ok(NetworkingResult {
        host_veth: host_veth.to_string(),
        container_mac,
    })
}

async fn add_route(h: &Handle, msg: RouteMessage, context: &str) -> Result<(), DataplaneError> {
    h.route()
        .add(msg)
        .execute()
        .await
        .map_err(|e| nl(context, e))
}

/// Sets ee:ee:ee:ee:ee:ee and waits (100 ms steps, 5 s) until the kernel reports it; if the
/// kernel refuses outright, keep its MAC (upstream only warns).
async fn set_host_mac(h: &Handle, idx: u32, name: &str) -> Result<(), DataplaneError> {
    let set = h
        .link()
        .set(
            LinkUnspec::new_with_index(idx)
                .address(HOST_MAC.to_vec())
                .build(),
        )
        .execute()
        .await;
    if let Err(e) = set {
        warn!(host_veth = name, error = %e, "failed to set the host MAC; using the kernel's");
        return Ok(());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if link_mac(&get_link(h, idx).await?).as_deref() == Some(&HOST_MAC[..]) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(DataplaneError::MacTimeout(name.to_string()));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn host_sysctls(h: &str, v4: bool, v6: bool) -> Result<(), String> {
    if v4 {
        sysctl::set(&format!("/proc/sys/net/ipv4/conf/{h}/route_localnet"), "1")?;
        if let Err(e) = sysctl::set(&format!("/proc/sys/net/ipv4/neigh/{h}/proxy_delay"), "0") {
            warn!("{e}");
        }
        sysctl::set(&format!("/proc/sys/net/ipv4/conf/{h}/proxy_arp"), "1")?;
        sysctl::set(&format!("/proc/sys/net/ipv4/conf/{h}/forwarding"), "1")?;
    }
    if v6 {
        sysctl::set(&format!("/proc/sys/net/ipv6/conf/{h}/accept_dad"), "0")?;
        sysctl::set(&format!("/proc/sys/net/ipv6/conf/{h}/disable_ipv6"), "0")?;
        sysctl::set(&format!("/proc/sys/net/ipv6/conf/{h}/proxy_ndp"), "1")?;
        sysctl::set(&format!("/proc/sys/net/ipv6/conf/{h}/forwarding"), "1")?;
    }
    if let Err(e) = sysctl::set(&format!("/proc/sys/net/ipv6/conf/{h}/accept_ra"), "0") {
        warn!("{e}");
    }
    Ok(())
}

fn container_sysctls(v4: bool, v6: bool, forward: bool) -> Result<(), String> {
    let v = if forward { "1" } else { "0" };
    if v4 {
        sysctl::set("/proc/sys/net/ipv4/ip_forward", v)?;
    }
    if v6 {
        sysctl::set("/proc/sys/net/ipv6/conf/all/forwarding", v)?;
    }
    Ok(())
}

/// Polls (10 × 50 ms) for the host end's link-local address, which pods use as their IPv6
/// next hop.
async fn wait_for_host_ipv6(h: &Handle, idx: u32) -> Result<(), DataplaneError> {
    for _ in 0..10 {
        let addrs: Vec<_> = h
            .address()
            .get()
            .set_link_index_filter(idx)
            .execute()
            .try_collect()
            .await
            .map_err(|e| {
                nl(
                    "error listing IPv6 addresses for the host side of the veth pair",
                    e,
                )
            })?;
        let found = addrs
            .iter()
            .flat_map(|m| m.attributes.iter())
            .any(|a| matches!(a, AddressAttribute::Address(IpAddr::V6(ip)) if *ip == GATEWAY_V6));
        if found {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(DataplaneError::NoHostIpv6)
}

fn route_dst(m: &RouteMessage) -> Option<IpAddr> {
    m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(ip)) => Some(IpAddr::V4(*ip)),
        RouteAttribute::Destination(RouteAddress::Inet6(ip)) => Some(IpAddr::V6(*ip)),
        _ => None,
    })
}

fn route_oif(m: &RouteMessage) -> Option<u32> {
    m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    })
}

fn scope_name(s: RouteScope) -> &'static str {
    match s {
        RouteScope::Universe => "universe",
        RouteScope::Site => "site",
        RouteScope::Link => "link",
        RouteScope::Host => "host",
        RouteScope::NoWhere => "nowhere",
        _ => "unknown",
    }
}

/// `<ip>/32 dev <host veth> scope link`. An identical route (Felix may have made it) is
/// fine; the same destination on another interface is upstream's conflict error.
async fn add_host_route(h: &Handle, idx: u32, name: &str, ip: &IpNet) -> Result<(), String> {
    let msg = match ip.addr {
        IpAddr::V4(a) => RouteMessageBuilder::<Ipv4Addr>::new()
            .destination_prefix(a, 32)
            .output_interface(idx)
            .scope(RouteScope::Link)
            .protocol(RouteProtocol::Boot)
            .build(),
        IpAddr::V6(a) => RouteMessageBuilder::<Ipv6Addr>::new()
            .destination_prefix(a, 128)
            .output_interface(idx)
            .scope(RouteScope::Link)
            .protocol(RouteProtocol::Boot)
            .build(),
    };
    let want = format!("route (Ifindex: {idx}, Dst: {ip}, Scope: link)");
    let err = match h.route().add(msg.clone()).execute().await {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    if errno(&err) != Some(EEXIST) {
        return Err(format!(
            "failed to add route (Ifindex: {idx}, Dst: {ip}, Scope: link, Iface: {name}): {err}"
        ));
    }
    let listing = match ip.addr {
        IpAddr::V4(_) => RouteMessageBuilder::<Ipv4Addr>::new().build(),
        IpAddr::V6(_) => RouteMessageBuilder::<Ipv6Addr>::new().build(),
    };
    let routes: Vec<RouteMessage> = h
        .route()
        .get(listing)
        .execute()
        .try_collect()
        .await
        .map_err(|_| "error listing routes".to_string())?;
    let same_dst: Vec<&RouteMessage> = routes
        .iter()
        .filter(|r| {
            route_dst(r) == Some(ip.addr) && r.header.destination_prefix_length == ip.prefix
        })
        .collect();
    if same_dst
        .iter()
        .any(|r| route_oif(r) == Some(idx) && r.header.scope == RouteScope::Link)
    {
        info!(
            host_veth = name,
            "CNI skipping add route. Route already exists"
        );
        return Ok(());
    }
    let mut conflict = String::new();
    if let Some(r) = same_dst.first() {
        let other = route_oif(r).unwrap_or(0);
        let other_name = match h.link().get().match_index(other).execute().try_next().await {
            Ok(Some(m)) => m
                .attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some(n.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| "unknown".into()),
            _ => "unknown".into(),
        };
        conflict = format!(
            "route (Ifindex: {other}, Dst: {ip}, Scope: {}, Iface: {other_name})",
            scope_name(r.header.scope)
        );
    }
    Err(format!(
        "{want} already exists for an interface other than '{name}': {conflict}"
    ))
}

/// Removes the pod's interface (which takes the host end and its routes with it). An empty
/// or missing netns, or a missing interface, is success. Bounded by 20 s.
pub fn clean_up_namespace(netns_path: &str, ifname: &str) -> Result<(), DataplaneError> {
    if netns_path.is_empty() {
        info!("CleanUpNamespace called with no netns name, ignoring.");
        return Ok(());
    }
    let ns = match File::open(netns_path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            info!(
                netns = netns_path,
                "netns does not exist; nothing to clean up"
            );
            return Ok(());
        }
        Err(e) => return Err(DataplaneError::EnterNetns(e.to_string())),
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let ifname = ifname.to_string();
    // A detached thread: a hung veth deletion must not hang the whole call.
    std::thread::spawn(move || {
        let r = netns::run_in(Some(&ns), |h| async move {
            match link_index(&h, &ifname).await {
                Ok(Some(idx)) => match h.link().del(idx).execute().await {
                    Ok(()) => Ok(()),
                    Err(e) if errno(&e) == Some(ENODEV) => Ok(()),
                    Err(e) => Err(DataplaneError::Cleanup(e.to_string())),
                },
                Ok(None) => Ok(()),
                Err(e) => Err(DataplaneError::Cleanup(e.to_string())),
            }
        });
        let _ = tx.send(r);
    });
    match rx.recv_timeout(CLEANUP_TIMEOUT) {
        Ok(r) => r,
        Err(_) => Err(DataplaneError::CleanupTimeout(netns_path.to_string())),
    }
}
