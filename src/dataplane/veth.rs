//! ADD's veth pair in two parts, so that the first can run while IPAM allocates:
//! * `create`: what needs no address — the pair with its names, MTU and queues, the host
//!   side's MAC, and, when the address families are already known, the link set-up that
//!   depends on them (`link_up`: sysctls on both sides, both ends up, the container MAC, the
//!   host side's IPv6 link-local address);
//! * `finish`: the rest once the addresses are known — `link_up` if it has not run (or ran
//!   for other families: then the pair is built again), the pod's routes and addresses,
//!   forwarding inside the pod and the host-side routes.
//!
//! The steps and their texts are upstream's `DoNetworking` (dataplane_linux.go); the step
//! numbers in the comments are its order. A failure in either part removes the pair this
//! call created (deleting the container end takes the host end and its routes with it).

use std::fs::File;
use std::net::{IpAddr, Ipv6Addr};
use std::time::Instant;

use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute};
use netlink_packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, LinkVeth};

use super::nl::{self, link_mac, lookup, nl_text, route_message};
use super::sys::{self, write_proc_sys};
use super::{
    internal, route, AddressRequest, DataplaneError, Families, NetworkingResult, Result,
    VethRequest, HOST_SIDE_LL, HOST_SIDE_MAC, IPV4_GATEWAY, LL_ATTEMPTS, LL_RETRY_INTERVAL,
    MAC_RETRY_INTERVAL, MAC_TIMEOUT,
};
use crate::net::{format_mac, IpNet};

/// What one ADD's dataplane works with: the request, the host netns (for the peer's
/// placement and the host sysctls) and a netlink handle on each side.
pub(super) struct Ctx<'a> {
    pub req: &'a VethRequest,
    pub host_ns: &'a File,
    pub host: &'a Handle,
    pub pod: &'a Handle,
}

/// The pair `create` made.
#[derive(Debug, Clone)]
pub(super) struct Made {
    /// The container end's ifindex in the pod netns: the handle for removing the pair.
    pub cont_idx: u32,
    host_idx: u32,
    /// The host side's link-local address, when its MAC is ee:ee:ee:ee:ee:ee.
    expected_ll: Option<Ipv6Addr>,
    /// Set once `link_up` has run.
    linked: Option<Linked>,
}

/// What `link_up` did, for the families it was given.
#[derive(Debug, Clone)]
struct Linked {
    families: Families,
    /// Lower-case `aa:bb:cc:dd:ee:ff`.
    container_mac: String,
    /// The host side's link-local address (IPv6 only): the pod's IPv6 next hop.
    host_ll: Option<Ipv6Addr>,
}

/// Whether a link named `name` exists (upstream ignores lookup errors here).
pub(super) async fn host_link_exists(host: &Handle, name: &str) -> bool {
    matches!(nl::link_by_name(host, name).await, Ok(Some(_)))
}

/// Step 1: a leftover host link with our name goes (its peer goes with it).
pub(super) async fn delete_old_host_link(host: &Handle, hv: &str) -> Result<()> {
    if let Ok(Some(old)) = nl::link_by_name(host, hv).await {
        host.link()
            .del(old.header.index)
            .execute()
            .await
            .map_err(|e| DataplaneError::DeleteOldHostVeth {
                name: hv.to_string(),
                reason: nl_text(&e),
            })?;
        tracing::info!("Cleaning old hostVeth: {hv}");
    }
    Ok(())
}

/// Creates the pair and configures what needs no address, plus `link_up` when `families`
/// is known. A failure after the pair exists removes it.
pub(super) async fn create(cx: &Ctx<'_>, families: Option<Families>) -> Result<Made> {
    create_veth(cx).await?;
    // From here on the pair is ours.
    let cv = cx.req.ifname.as_str();
    let cont_idx = lookup(cx.pod, cv)
        .await
        .map_err(|r| lookup_err(cv, r))?
        .header
        .index;
    let configured = async {
        let mut made = host_mac(cx, cont_idx).await?;
        if let Some(f) = families {
            made.linked = Some(link_up(cx, &made, f).await?);
        }
        Ok(made)
    }
    .await;
    undo_on_error(cx, cont_idx, configured).await
}

/// Completes the pair for `addrs`. A failure removes it.
pub(super) async fn finish(
    cx: &Ctx<'_>,
    mut made: Made,
    addrs: &AddressRequest,
) -> Result<NetworkingResult> {
    let families = Families::of(&addrs.ips);
    if made.linked.as_ref().is_some_and(|l| l.families != families) {
        // Built for the families the configuration promised, but IPAM gave others: the
        // order-sensitive steps (no DAD before link up) cannot be redone on a live pair.
        tracing::warn!(
            ?families,
            "The addresses' families differ from the expected ones; building the veth pair again."
        );
        remove_pair(cx.pod, made.cont_idx).await?;
        made = create(cx, Some(families)).await?;
    }
    let cont_idx = made.cont_idx;
    let done = async {
        let linked = match made.linked.take() {
            Some(l) => l,
            None => link_up(cx, &made, families).await?,
        };
        address(cx, &made, &linked, addrs).await
    }
    .await;
    undo_on_error(cx, cont_idx, done).await
}

/// Removes the pair after `result` failed, and passes `result` on.
async fn undo_on_error<T>(cx: &Ctx<'_>, cont_idx: u32, result: Result<T>) -> Result<T> {
    if let Err(e) = &result {
        tracing::info!("Removing the veth pair this call created after: {e}");
        if let Err(del) = remove_pair(cx.pod, cont_idx).await {
            tracing::warn!("failed to remove veth {}: {del}", cx.req.ifname);
        }
    }
    result
}

async fn remove_pair(pod: &Handle, cont_idx: u32) -> Result<()> {
    pod.link()
        .del(cont_idx)
        .execute()
        .await
        .map_err(|e| DataplaneError::CleanUpLink(nl_text(&e)))
}

/// One RTM_NEWLINK from inside the pod netns: container end `ifname`, peer `host_veth` placed
/// straight into the host netns; MTU and queue counts on both ends.
async fn create_veth(cx: &Ctx<'_>) -> Result<()> {
    use std::os::fd::AsRawFd;

    let req = cx.req;
    let mut peer = LinkUnspec::new_with_name(&req.host_veth);
    let mut veth = LinkVeth::new(&req.ifname, &req.host_veth);
    if req.mtu > 0 {
        peer = peer.mtu(req.mtu);
        veth = veth.mtu(req.mtu);
    }
    if req.num_queues > 0 {
        peer = peer
            .append_extra_attribute(LinkAttribute::NumTxQueues(req.num_queues))
            .append_extra_attribute(LinkAttribute::NumRxQueues(req.num_queues));
        veth = veth
            .append_extra_attribute(LinkAttribute::NumTxQueues(req.num_queues))
            .append_extra_attribute(LinkAttribute::NumRxQueues(req.num_queues));
    }
    // `host_ns` outlives this call, so the raw fd stays valid while the kernel reads it.
    let peer = peer
        .append_extra_attribute(LinkAttribute::NetNsFd(cx.host_ns.as_raw_fd()))
        .build();
    let msg = veth
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    cx.pod.link().add(msg).execute().await.map_err(|e| {
        tracing::error!("Error adding veth {}/{}: {e}", req.ifname, req.host_veth);
        DataplaneError::CreateVeth(nl_text(&e))
    })
}

/// Step 3: the host side's MAC, read back until the kernel shows it.
async fn host_mac(cx: &Ctx<'_>, cont_idx: u32) -> Result<Made> {
    let (host, hv) = (cx.host, cx.req.host_veth.as_str());
    let mut host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
    let host_idx = host_link.header.index;
    let mut expected_ll = None;
    let (mac_wait, mac_capped) = crate::deadline::cap(MAC_TIMEOUT);
    let mac_deadline = Instant::now() + mac_wait;
    loop {
        if let Err(e) = nl::set_mac(host, host_idx, &HOST_SIDE_MAC).await {
            tracing::warn!(
                "failed to Set MAC of {hv:?}: {}. Using kernel generated MAC.",
                nl_text(&e)
            );
            break;
        }
        host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
        let mac = link_mac(&host_link).unwrap_or_default();
        if mac == HOST_SIDE_MAC {
            tracing::info!("Read back correct host-side MAC.");
            expected_ll = Some(HOST_SIDE_LL);
            break;
        }
        tracing::warn!(
            "Host-side veth MAC {} does not match expected ee:ee:ee:ee:ee:ee. Retrying...",
            format_mac(&mac)
        );
        if Instant::now() >= mac_deadline {
            if mac_capped {
                return Err(crate::deadline::expired(format!(
                    "waiting for host veth {hv:?} to accept MAC ee:ee:ee:ee:ee:ee"
                ))
                .into());
            }
            return Err(DataplaneError::MacTimeout(hv.to_string()));
        }
        tokio::time::sleep(MAC_RETRY_INTERVAL).await;
    }
    Ok(Made {
        cont_idx,
        host_idx,
        expected_ll,
        linked: None,
    })
}

/// Steps 5–8 and the first half of 10: what depends on the address families but not on
/// the addresses.
async fn link_up(cx: &Ctx<'_>, made: &Made, families: Families) -> Result<Linked> {
    let (hv, cv) = (cx.req.host_veth.as_str(), cx.req.ifname.as_str());
    let (host, pod) = (cx.host, cx.pod);

    // 5. No DAD on the container side (must precede link up).
    if families.v6 {
        let path = format!("/proc/sys/net/ipv6/conf/{cv}/accept_dad");
        write_proc_sys(&path, "0").map_err(|reason| DataplaneError::DisableDad {
            name: cv.to_string(),
            reason,
        })?;
    }

    // 6. Host-side sysctls, written from a thread in the host netns.
    sys::run_in_netns(cx.host_ns, "/proc/thread-self/ns/net", || {
        host_sysctls(hv, families)
    })
    .map_err(internal)?
    .map_err(|reason| DataplaneError::HostSysctls {
        iface: hv.to_string(),
        reason,
    })?;

    // 7. Both ends up.
    nl::set_up(host, made.host_idx)
        .await
        .map_err(|e| up_err(hv, &e))?;
    let cont_link = lookup(pod, cv).await.map_err(|r| lookup_err(cv, r))?;
    nl::set_up(pod, made.cont_idx)
        .await
        .map_err(|e| up_err(cv, &e))?;

    // 8. Container MAC: the annotated one, else the kernel's.
    let container_mac = match cx.req.container_mac {
        Some(mac) => {
            nl::set_mac(pod, made.cont_idx, &mac).await.map_err(|e| {
                DataplaneError::ContainerMac {
                    mac: format_mac(&mac),
                    reason: nl_text(&e),
                }
            })?;
            tracing::info!(
                "successfully configured container veth MAC to {} as requested via cni.projectcalico.org/hwAddr",
                format_mac(&mac)
            );
            format_mac(&mac)
        }
        None => format_mac(&link_mac(&cont_link).unwrap_or_default()),
    };

    // 10a. IPv6: enable it in the pod, wait for the host side's link-local address.
    let mut host_ll = None;
    if families.v6 {
        for conf in ["all", "default", "lo"] {
            let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
            write_proc_sys(&path, "0")
                .map_err(|reason| DataplaneError::ContainerEnableIpv6 { conf, reason })?;
        }
        host_ll = Some(wait_host_link_local(host, hv, made.host_idx, made.expected_ll).await?);
    }
    Ok(Linked {
        families,
        container_mac,
        host_ll,
    })
}

/// Steps 9, 10b and 11–13: routes and addresses in the pod, forwarding, host routes.
async fn address(
    cx: &Ctx<'_>,
    made: &Made,
    linked: &Linked,
    addrs: &AddressRequest,
) -> Result<NetworkingResult> {
    let (hv, cv) = (cx.req.host_veth.as_str(), cx.req.ifname.as_str());
    let (host, pod, cont_idx) = (cx.host, cx.pod, made.cont_idx);
    let families = linked.families;
    // Masks forced to the host prefix.
    let ips: Vec<IpNet> = addrs.ips.iter().map(|ip| IpNet::host(ip.addr)).collect();

    // 9. IPv4: link route to the dummy gateway, then each route through it.
    if families.v4 {
        let gw_net = IpNet::host(IpAddr::V4(IPV4_GATEWAY));
        pod.route()
            .add(route_message(gw_net, None, cont_idx, RouteScope::Link))
            .execute()
            .await
            .map_err(|e| DataplaneError::GatewayRoute(nl_text(&e)))?;
        for r in addrs.routes.iter().filter(|r| r.is_ipv4()) {
            add_container_route(pod, cont_idx, *r, IpAddr::V4(IPV4_GATEWAY)).await?;
        }
    }

    // 10b. IPv6: each route via the host side's link-local address.
    if let Some(gw) = linked.host_ll {
        for r in addrs.routes.iter().filter(|r| !r.is_ipv4()) {
            add_container_route(pod, cont_idx, *r, IpAddr::V6(gw)).await?;
        }
    }

    // 11. Addresses.
    for ip in &ips {
        pod.address()
            .add(cont_idx, ip.addr, ip.prefix)
            .execute()
            .await
            .map_err(|e| DataplaneError::AddAddr {
                name: cv.to_string(),
                reason: nl_text(&e),
            })?;
    }

    // 12. Forwarding inside the pod.
    container_sysctls(families, addrs.allow_ip_forwarding)
        .map_err(DataplaneError::ContainerSysctls)?;

    // 13. Host-side routes to the pod.
    let host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
    if addrs.skip_host_routes {
        tracing::info!("Skipping host-side route setup (skipHostSideRoutes=true)");
    } else {
        route::setup_host_routes(host, hv, host_link.header.index, &ips)
            .await
            .map_err(|reason| DataplaneError::HostRoutes {
                iface: hv.to_string(),
                reason,
            })?;
    }

    Ok(NetworkingResult {
        host_veth: cx.req.host_veth.clone(),
        container_mac: linked.container_mac.clone(),
        container_index: cont_idx,
    })
}

async fn add_container_route(pod: &Handle, cont_idx: u32, dst: IpNet, gw: IpAddr) -> Result<()> {
    // Go's ParseCIDR hands upstream the network address; do the same for unmasked input.
    let dst = dst.masked();
    tracing::info!(route = %dst, "Adding IPv{} route (inside container)", dst.version());
    pod.route()
        .add(route_message(dst, Some(gw), cont_idx, RouteScope::Universe))
        .execute()
        .await
        .map_err(|e| DataplaneError::ContainerRoute {
            version: dst.version(),
            dst,
            gw,
            reason: nl_text(&e),
        })
}

/// Polls the host end for its IPv6 link-local address (10 × 50 ms). If it was derived from the
/// kernel's random MAC instead of ee:ee:.., toggles the link down/up to regenerate it.
async fn wait_host_link_local(
    host: &Handle,
    hv: &str,
    host_idx: u32,
    expected: Option<Ipv6Addr>,
) -> Result<Ipv6Addr> {
    let mut last_err = DataplaneError::NoHostIpv6;
    for attempt in 0..LL_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep(LL_RETRY_INTERVAL).await;
            crate::deadline::check(format!(
                "waiting for the IPv6 link-local address of host veth {hv:?}"
            ))?;
            tracing::info!("Retry lookup of host-side IPv6 link local address...");
        }
        let addrs = match nl::ipv6_addresses(host, host_idx).await {
            Ok(a) => a,
            Err(e) => {
                tracing::error!(
                    "Error listing IPv6 addresses for the host side of the veth pair: {}",
                    nl_text(&e)
                );
                Vec::new()
            }
        };
        let Some(&first) = addrs.first() else {
            last_err = DataplaneError::NoHostIpv6;
            continue;
        };
        if expected.is_some_and(|want| want != first) {
            tracing::warn!(
                "Host-side veth received unexpected link-local IP; toggling it down/up to reset the IP."
            );
            let down_err = |e: rtnetlink::Error| DataplaneError::LinkDown {
                name: hv.to_string(),
                reason: nl_text(&e),
            };
            nl::set_down(host, host_idx).await.map_err(down_err)?;
            if nl::set_mac(host, host_idx, &HOST_SIDE_MAC).await.is_err() {
                tracing::warn!(
                    "Failed to set the host-side MAC (while trying to reset the link local IP)."
                );
            }
            tokio::time::sleep(LL_RETRY_INTERVAL).await;
            nl::set_up(host, host_idx).await.map_err(down_err)?;
            last_err = DataplaneError::WrongLinkLocal(first);
            continue;
        }
        tracing::info!("Host-side veth link-local IP found: {first}");
        return Ok(first);
    }
    tracing::error!("Gave up waiting for host-side link local address: {last_err}.");
    Err(last_err)
}

/// Host-side sysctls for the host veth (`configureSysctls`); returns the inner error text.
/// Must run on a thread in the host netns.
pub(super) fn host_sysctls(hv: &str, families: Families) -> Result<(), String> {
    let set = |family: &str, kind: &str, key: &str, value: &str| {
        let path = format!("/proc/sys/net/{family}/{kind}/{hv}/{key}");
        write_proc_sys(&path, value)
            .map_err(|e| format!("failed to set net.{family}.{kind}.{hv}.{key}={value}: {e}"))
    };
    if families.v4 {
        set("ipv4", "conf", "route_localnet", "1")?;
        if let Err(e) = set("ipv4", "neigh", "proxy_delay", "0") {
            tracing::warn!("{e}");
        }
        set("ipv4", "conf", "proxy_arp", "1")?;
        set("ipv4", "conf", "forwarding", "1")?;
    }
    if families.v6 {
        set("ipv6", "conf", "accept_dad", "0")?;
        set("ipv6", "conf", "disable_ipv6", "0")?;
        set("ipv6", "conf", "proxy_ndp", "1")?;
        set("ipv6", "conf", "forwarding", "1")?;
    }
    if let Err(e) = set("ipv6", "conf", "accept_ra", "0") {
        tracing::warn!("{e}");
    }
    Ok(())
}

/// Forwarding inside the pod (`configureContainerSysctls`); must run in the pod netns.
fn container_sysctls(families: Families, allow: bool) -> Result<(), String> {
    let value = if allow { "1" } else { "0" };
    if families.v4 {
        write_proc_sys("/proc/sys/net/ipv4/ip_forward", value)?;
    }
    if families.v6 {
        write_proc_sys("/proc/sys/net/ipv6/conf/all/forwarding", value)?;
    }
    Ok(())
}

pub(super) fn lookup_err(name: &str, reason: String) -> DataplaneError {
    DataplaneError::Lookup {
        name: name.to_string(),
        reason,
    }
}

fn up_err(name: &str, e: &rtnetlink::Error) -> DataplaneError {
    DataplaneError::LinkUp {
        name: name.to_string(),
        reason: nl_text(e),
    }
}
