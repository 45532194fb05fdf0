//! The Linux dataplane: veth pair, MACs, addresses, routes and sysctls inside and outside the
//! pod's network namespace. Entry points: `do_networking` and `clean_up_namespace`.
//!
//! Threading model. The public functions are blocking and may be called from inside a tokio
//! `block_on`, so they never create a runtime on the calling thread. All netlink work happens
//! on short-lived spawned threads, each with its own current-thread runtime:
//! * the "host" netns is whatever netns the *calling thread* is in (`/proc/thread-self/ns/net`);
//! * the `do_networking` worker first opens a netlink socket in the host netns, then `setns()`es
//!   into the pod netns and opens a second socket there. A netlink socket stays bound to the
//!   netns it was created in, so the worker drives both sides, like upstream's host handle plus
//!   in-netns calls;
//! * `/proc/sys/net` resolves against the opening thread's netns, so host-side sysctls are
//!   written from a further helper thread that joins the host netns;
//! * every thread that entered the pod netns exits when its work is done.
//!
//! Every wait here (the MAC read-back, the link-local retry, the bounded netns deletion) also
//! ends at the call's deadline (`crate::deadline`), computed on the calling thread.

pub mod check;
mod nl;
mod route;
mod sys;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use netlink_packet_route::link::{InfoData, InfoVeth, LinkAttribute};
use netlink_packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, LinkVeth};

use crate::net::{format_mac, IpNet};
use nl::{link_mac, lookup, nl_text, route_message};
use sys::{block_on, connect, open_netns, write_proc_sys, NsOpenError};

/// MAC given to every host-side veth.
const HOST_SIDE_MAC: [u8; 6] = [0xee; 6];
/// The IPv6 link-local address the kernel derives (EUI-64) from `HOST_SIDE_MAC`.
const HOST_SIDE_LL: Ipv6Addr = Ipv6Addr::new(0xfe80, 0, 0, 0, 0xecee, 0xeeff, 0xfeee, 0xeeee);
/// Dummy IPv4 next hop inside the pod; the host answers ARP for it via proxy ARP.
const IPV4_GATEWAY: Ipv4Addr = Ipv4Addr::new(169, 254, 1, 1);
const MAC_RETRY_INTERVAL: Duration = Duration::from_millis(100);
const MAC_TIMEOUT: Duration = Duration::from_secs(5);
const LL_ATTEMPTS: usize = 10;
const LL_RETRY_INTERVAL: Duration = Duration::from_millis(50);
const CLEANUP_TIMEOUT: Duration = Duration::from_secs(20);

/// What `do_networking` sets up for one pod interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkingRequest {
    /// `CNI_NETNS`.
    pub netns_path: String,
    /// Container-side interface name (`CNI_IFNAME`).
    pub ifname: String,
    /// Host-side interface name, e.g. `cali1234567890a`.
    pub host_veth: String,
    /// 0 = kernel default.
    pub mtu: u32,
    /// Tx/rx queues on both ends; 0 = kernel default.
    pub num_queues: u32,
    /// Container addresses; prefixes are forced to /32 and /128.
    pub ips: Vec<IpNet>,
    /// Container route destinations (e.g. `0.0.0.0/0`, `::/0`), routed via 169.254.1.1 or the
    /// host side's link-local address, only for families that have an address.
    pub routes: Vec<IpNet>,
    pub allow_ip_forwarding: bool,
    /// From the `cni.projectcalico.org/hwAddr` annotation.
    pub container_mac: Option<[u8; 6]>,
    /// Leave the host-side /32|/128 routes to someone else (KubeVirt migration targets).
    pub skip_host_routes: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkingResult {
    pub host_veth: String,
    /// Lower-case `aa:bb:cc:dd:ee:ff`.
    pub container_mac: String,
    /// The ifindex of the container end this call created (see `remove_created_interface`).
    pub container_index: u32,
}

/// Errors, with upstream's (Calico v3.32 `dataplane_linux.go`) texts. OS and netlink causes are
/// rendered as Go renders them (`file exists`, `open <path>: no such file or directory`).
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("failed to create host netlink handle: {0}")]
    HostHandle(String),
    #[error("failed to delete old hostVeth {name}: {reason}")]
    DeleteOldHostVeth { name: String, reason: String },
    /// The pod netns could not be entered (containernetworking `ns` package texts).
    #[error("{0}")]
    Netns(String),
    /// Creating the veth pair failed; upstream returns the bare netlink error.
    #[error("{0}")]
    CreateVeth(String),
    #[error("failed to lookup {name:?}: {reason}")]
    Lookup { name: String, reason: String },
    #[error("timed out waiting for host veth {0:?} to accept MAC ee:ee:ee:ee:ee:ee")]
    MacTimeout(String),
    #[error("failed to disable DAD for {name}: {reason}")]
    DisableDad { name: String, reason: String },
    /// `reason` is e.g. `failed to set net.ipv4.conf.<h>.proxy_arp=1: <e>`.
    #[error("error configuring sysctls for interface: {iface}, error: {reason}")]
    HostSysctls { iface: String, reason: String },
    #[error("failed to set {name:?} up: {reason}")]
    LinkUp { name: String, reason: String },
    /// Upstream uses this text for both halves of the link-local "toggle" (down and up).
    #[error("failed to set {name:?} down: {reason}")]
    LinkDown { name: String, reason: String },
    #[error("failed to set container veth MAC to {mac} as requested via cni.projectcalico.org/hwAddr: {reason}")]
    ContainerMac { mac: String, reason: String },
    #[error("failed to add route inside the container: {0}")]
    GatewayRoute(String),
    #[error("failed to add IPv{version} route for {dst} via {gw}: {reason}")]
    ContainerRoute {
        version: u8,
        dst: IpNet,
        gw: IpAddr,
        reason: String,
    },
    #[error("failed to set net.ipv6.conf.{conf}.disable_ipv6=0: {reason}")]
    ContainerEnableIpv6 { conf: &'static str, reason: String },
    #[error("failed to get IPv6 addresses for host side of the veth pair")]
    NoHostIpv6,
    #[error("host-side veth got wrong link-local IP address: {0}")]
    WrongLinkLocal(Ipv6Addr),
    /// Upstream formats the whole Go link struct with `%q`; we print the interface name.
    #[error("failed to add IP addr to {name:?}: {reason}")]
    AddAddr { name: String, reason: String },
    #[error("error configuring sysctls for the container netns, error: {0}")]
    ContainerSysctls(String),
    /// `reason` is one of the `SetupRoutes` texts (`route (...) already exists for ...`).
    #[error("error adding host side routes for interface: {iface}, error: {reason}")]
    HostRoutes { iface: String, reason: String },
    #[error("failed to enter netns: {0}")]
    EnterNetns(String),
    #[error("failed to clean up workload's veth inside netns: {0}")]
    CleanUpLink(String),
    #[error("timed out deleting device in netns {0}")]
    CleanUpTimeout(String),
    /// CHECK found the kernel different from the previous result (`check.rs`).
    #[error("CHECK: {0}")]
    Check(String),
    /// The call's deadline passed during a wait (`crate::deadline`).
    #[error(transparent)]
    Deadline(#[from] crate::deadline::Expired),
    /// Thread or runtime failures that have no upstream counterpart.
    #[error("{0}")]
    Internal(String),
}

type Result<T, E = DataplaneError> = std::result::Result<T, E>;

/// Calico's `DoNetworking`: creates and configures the veth pair for one pod interface.
/// Unlike upstream, a failure after the veth pair was created removes that pair again: only
/// what this call created, never an interface that was there before (a pod's running
/// `eth0`, another call's veth).
pub fn do_networking(req: &NetworkingRequest) -> Result<NetworkingResult> {
    tracing::info!("Setting the host side veth name to {}", req.host_veth);
    let host_ns = sys::current_thread_netns().map_err(DataplaneError::Netns)?;
    std::thread::scope(|s| {
        s.spawn(|| worker(req, &host_ns))
            .join()
            .unwrap_or_else(|_| Err(internal("dataplane worker thread panicked")))
    })
}

/// Calico's `CleanUpNamespace`: deletes `ifname` inside the pod netns (which removes the host
/// end and its routes). A missing netns or interface is success. Bounded by 20 s and the
/// call's deadline; on timeout the deleting thread is abandoned (the process is about to exit
/// anyway).
pub fn clean_up_namespace(netns_path: &str, ifname: &str) -> Result<()> {
    if netns_path.is_empty() {
        tracing::info!("CleanUpNamespace called with no netns name, ignoring.");
        return Ok(());
    }
    tracing::info!(
        netns = netns_path,
        iface = ifname,
        "Deleting workload's device in netns."
    );
    delete_in_netns_bounded(netns_path, ifname, None)
}

/// Removes the container end this call created (after a later step of ADD failed), only if
/// `ifname` in the pod netns still is that very link (same ifindex): if something else has
/// replaced it meanwhile, it is left alone.
pub fn remove_created_interface(netns_path: &str, ifname: &str, index: u32) -> Result<()> {
    tracing::info!(
        netns = netns_path,
        iface = ifname,
        index,
        "Removing the interface this call created."
    );
    delete_in_netns_bounded(netns_path, ifname, Some(index))
}

/// Deletes `ifname` in the netns on a helper thread, bounded by 20 s and the call's deadline
/// (in an undo: plus its grace); on timeout the thread is abandoned (the process is about to
/// exit anyway).
fn delete_in_netns_bounded(netns_path: &str, ifname: &str, index: Option<u32>) -> Result<()> {
    let started = Instant::now();
    let (wait, capped) = crate::deadline::cap(CLEANUP_TIMEOUT);
    let (tx, rx) = mpsc::channel();
    let (path, name) = (netns_path.to_string(), ifname.to_string());
    std::thread::Builder::new()
        .name("calico-netns-del".into())
        .spawn(move || {
            let _ = tx.send(delete_in_netns(&path, &name, index));
        })
        .map_err(|e| internal(format!("failed to spawn a thread: {e}")))?;
    match rx.recv_timeout(wait) {
        Ok(r) => {
            if r.is_ok() {
                tracing::info!(after = ?started.elapsed(), "Deleted device in netns.");
            }
            r
        }
        Err(mpsc::RecvTimeoutError::Timeout) if capped => Err(crate::deadline::expired(format!(
            "deleting device {ifname:?} in netns {netns_path}"
        ))
        .into()),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            Err(DataplaneError::CleanUpTimeout(netns_path.to_string()))
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => Err(internal("netns cleanup thread panicked")),
    }
}

/// Whether a link with this name exists in the calling thread's netns.
pub fn host_link_exists(name: &str) -> Result<bool> {
    std::thread::scope(|s| {
        s.spawn(|| {
            block_on(async {
                let h = connect().map_err(|e| DataplaneError::HostHandle(e.to_string()))?;
                nl::link_by_name(&h, name)
                    .await
                    .map(|l| l.is_some())
                    .map_err(|e| DataplaneError::Lookup {
                        name: name.to_string(),
                        reason: nl_text(&e),
                    })
            })
            .map_err(internal)?
        })
        .join()
        .unwrap_or_else(|_| Err(internal("netlink thread panicked")))
    })
}

fn internal(msg: impl Into<String>) -> DataplaneError {
    DataplaneError::Internal(msg.into())
}

/// Deletes `ifname` (only when its ifindex is `index`, if given) inside the netns at `path`.
fn delete_in_netns(path: &str, ifname: &str, index: Option<u32>) -> Result<()> {
    let ns = match open_netns(path) {
        Ok(f) => f,
        Err(NsOpenError::NotExist(_)) => {
            tracing::info!("Workload's netns already gone.  Nothing to do.");
            return Ok(());
        }
        Err(NsOpenError::Other(m)) => return Err(DataplaneError::EnterNetns(m)),
    };
    sys::enter_netns(&ns, path).map_err(DataplaneError::EnterNetns)?;
    block_on(async {
        let h = connect().map_err(|e| DataplaneError::CleanUpLink(e.to_string()))?;
        let link = match nl::link_by_name(&h, ifname).await {
            Ok(Some(l)) => l,
            Ok(None) => {
                tracing::info!("Workload's veth was already gone.  Nothing to do.");
                return Ok(());
            }
            Err(e) => return Err(DataplaneError::CleanUpLink(nl_text(&e))),
        };
        if index.is_some_and(|i| i != link.header.index) {
            tracing::info!("Workload's veth was replaced by another; leaving it.");
            return Ok(());
        }
        h.link()
            .del(link.header.index)
            .execute()
            .await
            .map_err(|e| DataplaneError::CleanUpLink(nl_text(&e)))
    })
    .map_err(internal)?
}

/// Body of the `do_networking` worker thread. Starts in the host netns, ends in the pod netns,
/// and exits with the thread.
fn worker(req: &NetworkingRequest, host_ns: &std::fs::File) -> Result<NetworkingResult> {
    // The spawned thread inherits the caller's netns; joining it explicitly makes sure the
    // host socket and the host fd given to the kernel name the same namespace.
    sys::enter_netns(host_ns, "/proc/thread-self/ns/net").map_err(DataplaneError::Netns)?;
    block_on(async {
        let host = connect().map_err(|e| DataplaneError::HostHandle(e.to_string()))?;
        setup(req, host_ns, &host).await
    })
    .map_err(internal)?
}

async fn setup(
    req: &NetworkingRequest,
    host_ns: &std::fs::File,
    host: &Handle,
) -> Result<NetworkingResult> {
    let hv = req.host_veth.as_str();
    let cv = req.ifname.as_str();

    // 1. A leftover host link with our name goes (its peer goes with it).
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

    // 2. Into the pod netns; from here on this thread's /proc/sys is the pod's.
    let pod_ns =
        open_netns(&req.netns_path).map_err(|e| DataplaneError::Netns(e.into_message()))?;
    sys::enter_netns(&pod_ns, &req.netns_path).map_err(DataplaneError::Netns)?;
    let pod = connect().map_err(|e| internal(format!("failed to open netlink in netns: {e}")))?;

    create_veth(req, host_ns, &pod).await?;
    // From here on the pair is ours: any failure removes it again (deleting the container
    // end takes the host end and its routes with it).
    let cont_idx = lookup(&pod, cv)
        .await
        .map_err(|r| lookup_err(cv, r))?
        .header
        .index;
    match configure(req, host_ns, host, &pod, cont_idx).await {
        Ok(r) => Ok(r),
        Err(e) => {
            tracing::info!("Removing the veth pair this call created after: {e}");
            if let Err(del) = pod.link().del(cont_idx).execute().await {
                tracing::warn!("failed to remove the veth {cv}: {}", nl_text(&del));
            }
            Err(e)
        }
    }
}

/// Steps 3–13 of `DoNetworking`, on the veth pair `create_veth` just made.
async fn configure(
    req: &NetworkingRequest,
    host_ns: &std::fs::File,
    host: &Handle,
    pod: &Handle,
    cont_idx: u32,
) -> Result<NetworkingResult> {
    let hv = req.host_veth.as_str();
    let cv = req.ifname.as_str();

    // 3. Host-side MAC, read back until the kernel shows it.
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

    // 4. Address families, masks forced to the host prefix.
    let ips: Vec<IpNet> = req.ips.iter().map(|ip| IpNet::host(ip.addr)).collect();
    let has_v4 = ips.iter().any(IpNet::is_ipv4);
    let has_v6 = ips.iter().any(|ip| !ip.is_ipv4());

    // 5. No DAD on the container side (must precede link up).
    if has_v6 {
        let path = format!("/proc/sys/net/ipv6/conf/{cv}/accept_dad");
        write_proc_sys(&path, "0").map_err(|reason| DataplaneError::DisableDad {
            name: cv.to_string(),
            reason,
        })?;
    }

    // 6. Host-side sysctls, written from a thread in the host netns.
    sys::run_in_netns(host_ns, "/proc/thread-self/ns/net", || {
        host_sysctls(hv, has_v4, has_v6)
    })
    .map_err(internal)?
    .map_err(|reason| DataplaneError::HostSysctls {
        iface: hv.to_string(),
        reason,
    })?;

    // 7. Both ends up.
    nl::set_up(host, host_idx)
        .await
        .map_err(|e| up_err(hv, &e))?;
    let cont_link = lookup(pod, cv).await.map_err(|r| lookup_err(cv, r))?;
    nl::set_up(pod, cont_idx)
        .await
        .map_err(|e| up_err(cv, &e))?;

    // 8. Container MAC: the annotated one, else the kernel's.
    let container_mac = match req.container_mac {
        Some(mac) => {
            nl::set_mac(pod, cont_idx, &mac)
                .await
                .map_err(|e| DataplaneError::ContainerMac {
                    mac: format_mac(&mac),
                    reason: nl_text(&e),
                })?;
            tracing::info!(
                "successfully configured container veth MAC to {} as requested via cni.projectcalico.org/hwAddr",
                format_mac(&mac)
            );
            format_mac(&mac)
        }
        None => format_mac(&link_mac(&cont_link).unwrap_or_default()),
    };

    // 9. IPv4: link route to the dummy gateway, then each route through it.
    if has_v4 {
        let gw_net = IpNet::host(IpAddr::V4(IPV4_GATEWAY));
        pod.route()
            .add(route_message(gw_net, None, cont_idx, RouteScope::Link))
            .execute()
            .await
            .map_err(|e| DataplaneError::GatewayRoute(nl_text(&e)))?;
        for r in req.routes.iter().filter(|r| r.is_ipv4()) {
            add_container_route(pod, cont_idx, *r, IpAddr::V4(IPV4_GATEWAY)).await?;
        }
    }

    // 10. IPv6: enable it in the pod, wait for the host side's link-local address, route via it.
    if has_v6 {
        for conf in ["all", "default", "lo"] {
            let path = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
            write_proc_sys(&path, "0")
                .map_err(|reason| DataplaneError::ContainerEnableIpv6 { conf, reason })?;
        }
        let gw = wait_host_link_local(host, hv, host_idx, expected_ll).await?;
        for r in req.routes.iter().filter(|r| !r.is_ipv4()) {
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
    container_sysctls(has_v4, has_v6, req.allow_ip_forwarding)
        .map_err(DataplaneError::ContainerSysctls)?;

    // 13. Host-side routes to the pod.
    let host_link = lookup(host, hv).await.map_err(|r| lookup_err(hv, r))?;
    if req.skip_host_routes {
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
        host_veth: req.host_veth.clone(),
        container_mac,
        container_index: cont_idx,
    })
}

/// One RTM_NEWLINK from inside the pod netns: container end `ifname`, peer `host_veth` placed
/// straight into the host netns; MTU and queue counts on both ends.
async fn create_veth(req: &NetworkingRequest, host_ns: &std::fs::File, pod: &Handle) -> Result<()> {
    use std::os::fd::AsRawFd;

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
        .append_extra_attribute(LinkAttribute::NetNsFd(host_ns.as_raw_fd()))
        .build();
    let msg = veth
        .set_info_data(InfoData::Veth(InfoVeth::Peer(peer)))
        .build();
    pod.link().add(msg).execute().await.map_err(|e| {
        tracing::error!("Error adding veth {}/{}: {e}", req.ifname, req.host_veth);
        DataplaneError::CreateVeth(nl_text(&e))
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
fn host_sysctls(hv: &str, has_v4: bool, has_v6: bool) -> Result<(), String> {
    let set = |family: &str, kind: &str, key: &str, value: &str| {
        let path = format!("/proc/sys/net/{family}/{kind}/{hv}/{key}");
        write_proc_sys(&path, value)
            .map_err(|e| format!("failed to set net.{family}.{kind}.{hv}.{key}={value}: {e}"))
    };
    if has_v4 {
        set("ipv4", "conf", "route_localnet", "1")?;
        if let Err(e) = set("ipv4", "neigh", "proxy_delay", "0") {
            tracing::warn!("{e}");
        }
        set("ipv4", "conf", "proxy_arp", "1")?;
        set("ipv4", "conf", "forwarding", "1")?;
    }
    if has_v6 {
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
fn container_sysctls(has_v4: bool, has_v6: bool, allow: bool) -> Result<(), String> {
    let value = if allow { "1" } else { "0" };
    if has_v4 {
        write_proc_sys("/proc/sys/net/ipv4/ip_forward", value)?;
    }
    if has_v6 {
        write_proc_sys("/proc/sys/net/ipv6/conf/all/forwarding", value)?;
    }
    Ok(())
}

fn lookup_err(name: &str, reason: String) -> DataplaneError {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_side_link_local_matches_mac() {
        // EUI-64: flip the U/L bit of the first octet (ee -> ec), insert ff:fe.
        let mut b = [0u8; 16];
        b[0] = 0xfe;
        b[1] = 0x80;
        b[8] = HOST_SIDE_MAC[0] ^ 0x02;
        b[9] = HOST_SIDE_MAC[1];
        b[10] = HOST_SIDE_MAC[2];
        b[11] = 0xff;
        b[12] = 0xfe;
        b[13..16].copy_from_slice(&HOST_SIDE_MAC[3..6]);
        assert_eq!(Ipv6Addr::from(b), HOST_SIDE_LL);
        assert_eq!(HOST_SIDE_LL.to_string(), "fe80::ecee:eeff:feee:eeee");
    }

    #[test]
    fn error_texts() {
        let e = DataplaneError::MacTimeout("cali123".into());
        assert_eq!(
            e.to_string(),
            "timed out waiting for host veth \"cali123\" to accept MAC ee:ee:ee:ee:ee:ee"
        );
        let e = DataplaneError::HostSysctls {
            iface: "cali1".into(),
            reason: "failed to set net.ipv4.conf.cali1.proxy_arp=1: open /x: permission denied"
                .into(),
        };
        assert_eq!(
            e.to_string(),
            "error configuring sysctls for interface: cali1, error: failed to set \
             net.ipv4.conf.cali1.proxy_arp=1: open /x: permission denied"
        );
        let e = DataplaneError::ContainerRoute {
            version: 4,
            dst: "0.0.0.0/0".parse().unwrap(),
            gw: IpAddr::V4(IPV4_GATEWAY),
            reason: "file exists".into(),
        };
        assert_eq!(
            e.to_string(),
            "failed to add IPv4 route for 0.0.0.0/0 via 169.254.1.1: file exists"
        );
        assert_eq!(
            DataplaneError::CleanUpTimeout("/run/netns/x".into()).to_string(),
            "timed out deleting device in netns /run/netns/x"
        );
        assert_eq!(
            DataplaneError::LinkUp {
                name: "eth0".into(),
                reason: "no such device".into()
            }
            .to_string(),
            "failed to set \"eth0\" up: no such device"
        );
    }

    #[test]
    fn host_sysctl_error_text() {
        // The link does not exist, so the first (fatal) write fails with Go's PathError text.
        let err = host_sysctls("calidoesnotexist", true, false).unwrap_err();
        assert_eq!(
            err,
            "failed to set net.ipv4.conf.calidoesnotexist.route_localnet=1: open \
             /proc/sys/net/ipv4/conf/calidoesnotexist/route_localnet: no such file or directory"
        );
    }

    #[test]
    fn clean_up_trivial_cases() {
        assert!(clean_up_namespace("", "eth0").is_ok());
        assert!(clean_up_namespace("/run/netns/definitely-not-there-xyz", "eth0").is_ok());
        let err = clean_up_namespace("/dev", "eth0").unwrap_err().to_string();
        assert!(
            err.starts_with("failed to enter netns: unknown FS magic on \"/dev\""),
            "{err}"
        );
    }
}
