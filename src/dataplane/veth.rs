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
//!
//! Everything runs on the caller's runtime through the call's `Netns` handles; only the
//! pod's IPv6 sysctls take a thread into the pod netns (they name the new interface), and
//! removing the pair runs on a thread of its own (`Netns::start_delete`).

use std::net::{IpAddr, Ipv6Addr};
use std::time::{Duration, Instant};

use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute};
use netlink_packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, LinkVeth};

use super::netns::Netns;
use super::nl::{self, link_mac, lookup, nl_text, route_message};
use super::sys::{set_sysctl, SysctlFile};
use super::{
    route, AddressRequest, DataplaneError, Families, LookupError, NetworkingResult, PodSysctlError,
    Result, SetSysctlError, VethRequest, HOST_SIDE_LL, HOST_SIDE_MAC, IPV4_GATEWAY, LL_ATTEMPTS,
    LL_RETRY_INTERVAL, MAC_RETRY_INTERVAL, MAC_TIMEOUT,
};
use crate::support::net::{format_mac, IpNet};

/// How often the host side is looked at for its IPv6 link-local address until the first
/// retry: the kernel adds it moments after link up.
const LL_FIRST_POLL: Duration = Duration::from_millis(2);

/// What one ADD's dataplane works with: the request and the call's handles on both sides.
pub(super) struct Ctx<'a> {
    pub req: &'a VethRequest,
    pub ns: &'a Netns,
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
            .map_err(|source| DataplaneError::DeleteOldHostVeth {
                name: hv.to_string(),
                source,
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
    let cont_idx = lookup(&cx.ns.pod, cv)
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
    made: &mut Made,
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
        remove_pair(cx, made.cont_idx).await?;
        *made = create(cx, Some(families)).await?;
    }
    let done = async {
        let linked = match made.linked.clone() {
            Some(l) => l,
            None => link_up(cx, made, families).await?,
        };
        address(cx, made, &linked, addrs).await
    }
    .await;
    undo_on_error(cx, made.cont_idx, done).await
}

/// The container MAC `finish` will report for addresses of `families`: `link_up`'s, if it
/// ran for those families (for others, `finish` builds the pair again).
pub(super) fn known_mac(made: &Made, families: Families) -> Option<String> {
    let linked = made.linked.as_ref()?;
    (linked.families == families).then(|| linked.container_mac.to_lowercase())
}

/// Removes the pair after `result` failed, and passes `result` on.
async fn undo_on_error<T>(cx: &Ctx<'_>, cont_idx: u32, result: Result<T>) -> Result<T> {
    if let Err(e) = &result {
        tracing::info!("Removing the veth pair this call created after: {e}");
        if let Err(del) = remove_pair(cx, cont_idx).await {
            tracing::warn!("failed to remove veth {}: {del}", cx.req.ifname);
        }
    }
    result
}

/// Removes the pair by its container end (bounded, on a thread of its own).
pub(super) async fn remove_pair(cx: &Ctx<'_>, cont_idx: u32) -> Result<()> {
    cx.ns.start_delete(&cx.req.ifname, cont_idx).finish().await
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
        .append_extra_attribute(LinkAttribute::NetNsFd(cx.ns.host_ns.as_raw_fd()))
        .build();
    let msg = veth
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    cx.ns.pod.link().add(msg).execute().await.map_err(|e| {
        tracing::error!("Error adding veth {}/{}: {e}", req.ifname, req.host_veth);
        DataplaneError::CreateVeth(e)
    })
}

/// Step 3: the host side's MAC, read back until the kernel shows it.
async fn host_mac(cx: &Ctx<'_>, cont_idx: u32) -> Result<Made> {
    let (host, hv) = (&cx.ns.host, cx.req.host_veth.as_str());
    let mut host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
    let host_idx = host_link.header.index;
    let mut expected_ll = None;
    let (mac_wait, mac_capped) = crate::support::deadline::cap(MAC_TIMEOUT);
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
                return Err(crate::support::deadline::expired(format!(
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
    let (host, pod) = (&cx.ns.host, &cx.ns.pod);

    // 5 and 10a's sysctls. IPv6: no DAD on the container side (must precede link up), and
    // IPv6 enabled in the pod: one trip of a thread into the pod netns.
    if families.v6 {
        let cv = cv.to_string();
        cx.ns.in_pod(move || pod_ipv6_sysctls(&cv)).await??;
    }

    // 6. Host-side sysctls: this (the runtime's) thread is in the host netns.
    host_sysctls(hv, families).map_err(|source| DataplaneError::HostSysctls {
        iface: hv.to_string(),
        source,
    })?;

    // 7. Both ends up.
    nl::set_up(host, made.host_idx)
        .await
        .map_err(|e| up_err(hv, e))?;
    let cont_link = lookup(pod, cv).await.map_err(|r| lookup_err(cv, r))?;
    nl::set_up(pod, made.cont_idx)
        .await
        .map_err(|e| up_err(cv, e))?;

    // 8. Container MAC: the annotated one, else the kernel's.
    let container_mac = match cx.req.container_mac {
        Some(mac) => set_annotated_mac(cx, made.cont_idx, &mac).await?,
        None => format_mac(&link_mac(&cont_link).unwrap_or_default()),
    };

    // 10a. IPv6: wait for the host side's link-local address.
    let mut host_ll = None;
    if families.v6 {
        host_ll = Some(wait_host_link_local(host, hv, made.host_idx, made.expected_ll).await?);
    }
    Ok(Linked {
        families,
        container_mac,
        host_ll,
    })
}

/// Step 8 with the `cni.projectcalico.org/hwAddr` annotation: its MAC on the container end.
async fn set_annotated_mac(cx: &Ctx<'_>, cont_idx: u32, mac: &[u8; 6]) -> Result<String> {
    nl::set_mac(&cx.ns.pod, cont_idx, mac)
        .await
        .map_err(|source| DataplaneError::ContainerMac {
            mac: format_mac(mac),
            source,
        })?;
    tracing::info!(
        "successfully configured container veth MAC to {} as requested via cni.projectcalico.org/hwAddr",
        format_mac(mac)
    );
    Ok(format_mac(mac))
}

/// Steps 9, 10b and 11–13: routes and addresses in the pod, forwarding, host routes.
async fn address(
    cx: &Ctx<'_>,
    made: &Made,
    linked: &Linked,
    addrs: &AddressRequest,
) -> Result<NetworkingResult> {
    let (hv, cv) = (cx.req.host_veth.as_str(), cx.req.ifname.as_str());
    let (host, pod, cont_idx) = (&cx.ns.host, &cx.ns.pod, made.cont_idx);
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
            .map_err(DataplaneError::GatewayRoute)?;
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
            .map_err(|source| DataplaneError::AddAddr {
                name: cv.to_string(),
                source,
            })?;
    }

    // 12. Forwarding inside the pod.
    container_sysctls(cx.ns, families, addrs.allow_ip_forwarding)
        .await
        .map_err(DataplaneError::ContainerSysctls)?;

    // 13. Host-side routes to the pod.
    let host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
    if addrs.skip_host_routes {
        tracing::info!("Skipping host-side route setup (skipHostSideRoutes=true)");
    } else {
        route::setup_host_routes(host, hv, host_link.header.index, &ips)
            .await
            .map_err(|source| DataplaneError::HostRoutes {
                iface: hv.to_string(),
                source: Box::new(source),
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
        .map_err(|source| DataplaneError::ContainerRoute {
            version: dst.version(),
            dst,
            gw,
            source,
        })
}

/// Polls the host end for its IPv6 link-local address (10 attempts 50 ms apart; the first
/// one looks every 2 ms meanwhile, as the kernel adds the address moments after link up).
/// If it was derived from the kernel's random MAC instead of ee:ee:.., toggles the link
/// down/up to regenerate it.
async fn wait_host_link_local(
    host: &Handle,
    hv: &str,
    host_idx: u32,
    expected: Option<Ipv6Addr>,
) -> Result<Ipv6Addr> {
    let mut last_err = DataplaneError::NoHostIpv6;
    let first_retry = Instant::now() + LL_RETRY_INTERVAL;
    let mut next = first_retry;
    for attempt in 0..LL_ATTEMPTS {
        if attempt > 0 {
            tokio::time::sleep_until(next.into()).await;
            crate::support::deadline::check(format!(
                "waiting for the IPv6 link-local address of host veth {hv:?}"
            ))?;
            tracing::info!("Retry lookup of host-side IPv6 link local address...");
        }
        let mut addrs = ipv6_addresses(host, host_idx).await;
        while attempt == 0 && addrs.is_empty() && Instant::now() + LL_FIRST_POLL < first_retry {
            tokio::time::sleep(LL_FIRST_POLL).await;
            addrs = ipv6_addresses(host, host_idx).await;
        }
        let Some(&first) = addrs.first() else {
            last_err = DataplaneError::NoHostIpv6;
            next = match attempt {
                0 => first_retry,
                _ => Instant::now() + LL_RETRY_INTERVAL,
            };
            continue;
        };
        if expected.is_some_and(|want| want != first) {
            tracing::warn!(
                "Host-side veth received unexpected link-local IP; toggling it down/up to reset the IP."
            );
            let down_err = |source| DataplaneError::LinkDown {
                name: hv.to_string(),
                source,
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
            next = Instant::now() + LL_RETRY_INTERVAL;
            continue;
        }
        tracing::info!("Host-side veth link-local IP found: {first}");
        return Ok(first);
    }
    tracing::error!("Gave up waiting for host-side link local address: {last_err}.");
    Err(last_err)
}

/// The IPv6 addresses on a link (none when they cannot be listed: logged).
async fn ipv6_addresses(host: &Handle, index: u32) -> Vec<Ipv6Addr> {
    nl::ipv6_addresses(host, index).await.unwrap_or_else(|e| {
        tracing::error!(
            "Error listing IPv6 addresses for the host side of the veth pair: {}",
            nl_text(&e)
        );
        Vec::new()
    })
}

/// The pod's IPv6 sysctls (`accept_dad` of the container end, `disable_ipv6`); must run on
/// a thread in the pod netns.
fn pod_ipv6_sysctls(cv: &str) -> Result<()> {
    let path = format!("/proc/sys/net/ipv6/conf/{cv}/accept_dad");
    set_sysctl(&path, "0").map_err(|source| DataplaneError::DisableDad {
        name: cv.to_string(),
        source,
    })?;
    for conf in ["all", "default", "lo"] {
        let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
        set_sysctl(&path, "0")
            .map_err(|source| DataplaneError::ContainerEnableIpv6 { conf, source })?;
    }
    Ok(())
}

/// Host-side sysctls for the host veth (`configureSysctls`); the error is the inner one.
/// Must run on a thread in the host netns.
pub(super) fn host_sysctls(hv: &str, families: Families) -> Result<(), SetSysctlError> {
    let set = |family: &str, kind: &str, key: &str, value: &'static str| {
        let path = format!("/proc/sys/net/{family}/{kind}/{hv}/{key}");
        set_sysctl(&path, value).map_err(|source| SetSysctlError {
            key: format!("net.{family}.{kind}.{hv}.{key}"),
            value,
            source,
        })
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

/// Forwarding inside the pod (`configureContainerSysctls`), through the files `Netns` opened
/// in the pod netns (a thread goes in for a family it did not open them for).
async fn container_sysctls(
    ns: &Netns,
    families: Families,
    allow: bool,
) -> Result<(), PodSysctlError> {
    let value = if allow { "1" } else { "0" };
    if families.v4 {
        set_in_pod(
            ns,
            &ns.forwarding_v4,
            "/proc/sys/net/ipv4/ip_forward",
            value,
        )
        .await?;
    }
    if families.v6 {
        let path = "/proc/sys/net/ipv6/conf/all/forwarding";
        set_in_pod(ns, &ns.forwarding_v6, path, value).await?;
    }
    Ok(())
}

async fn set_in_pod(
    ns: &Netns,
    file: &Option<SysctlFile>,
    path: &'static str,
    value: &'static str,
) -> Result<(), PodSysctlError> {
    match file {
        Some(f) => Ok(f.set(value)?),
        None => Ok(ns
            .in_pod(move || set_sysctl(path, value))
            .await
            .map_err(PodSysctlError::Thread)??),
    }
}

pub(super) fn lookup_err(name: &str, source: LookupError) -> DataplaneError {
    DataplaneError::Lookup {
        name: name.to_string(),
        source,
    }
}

fn up_err(name: &str, source: rtnetlink::Error) -> DataplaneError {
    DataplaneError::LinkUp {
        name: name.to_string(),
        source,
    }
}
