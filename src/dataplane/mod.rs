//! The Linux dataplane: veth pair, MACs, addresses, routes and sysctls inside and outside the
//! pod's network namespace. Entry points: `build` then `PodLink::finish` (ADD, in two parts
//! so that the first runs while IPAM allocates; `veth.rs`), `do_networking` (both at once),
//! `clean_up_namespace` (DEL).
//!
//! Threading model. The functions never create a runtime on the calling thread (they may be
//! called from inside a tokio `block_on`). All netlink work happens on short-lived spawned
//! threads, each with its own current-thread runtime:
//! * the "host" netns is whatever netns the *calling thread* is in (`/proc/thread-self/ns/net`);
//! * the ADD workers first open a netlink socket in the host netns, then `setns()` into the
//!   pod netns and open a second socket there. A netlink socket stays bound to the netns it
//!   was created in, so a worker drives both sides, like upstream's host handle plus
//!   in-netns calls;
//! * `/proc/sys/net` resolves against the opening thread's netns, so host-side sysctls are
//!   written from a further helper thread that joins the host netns;
//! * every thread that entered the pod netns exits when its work is done.
//!
//! Every wait here (the MAC read-back, the link-local retry, the bounded netns deletion) also
//! ends at the call's deadline (`crate::deadline`).

pub mod check;
mod nl;
mod route;
mod sys;
mod veth;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rtnetlink::Handle;

use crate::net::IpNet;
use nl::nl_text;
use sys::{block_on, connect, open_netns, NsOpenError};

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

/// The address families of a pod's addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Families {
    pub v4: bool,
    pub v6: bool,
}

impl Families {
    pub fn of(ips: &[IpNet]) -> Families {
        Families {
            v4: ips.iter().any(IpNet::is_ipv4),
            v6: ips.iter().any(|ip| !ip.is_ipv4()),
        }
    }
}

/// The part of `NetworkingRequest` that needs no address: what `build` makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VethRequest {
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
    /// From the `cni.projectcalico.org/hwAddr` annotation.
    pub container_mac: Option<[u8; 6]>,
    /// The families the addresses will have, when known before IPAM answers: the
    /// family-dependent link set-up (sysctls, link up, the IPv6 link-local wait) then runs
    /// in `build` too. If IPAM's addresses turn out to have other families, `finish`
    /// builds the pair again.
    pub families: Option<Families>,
}

/// The part of `NetworkingRequest` that needs the addresses: what `PodLink::finish` adds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddressRequest {
    /// Container addresses; prefixes are forced to /32 and /128.
    pub ips: Vec<IpNet>,
    /// Container route destinations (e.g. `0.0.0.0/0`, `::/0`), routed via 169.254.1.1 or the
    /// host side's link-local address, only for families that have an address.
    pub routes: Vec<IpNet>,
    pub allow_ip_forwarding: bool,
    /// Leave the host-side /32|/128 routes to someone else (KubeVirt migration targets).
    pub skip_host_routes: bool,
}

impl NetworkingRequest {
    /// The two halves, the families taken from the addresses.
    pub fn parts(&self) -> (VethRequest, AddressRequest) {
        let veth = VethRequest {
            netns_path: self.netns_path.clone(),
            ifname: self.ifname.clone(),
            host_veth: self.host_veth.clone(),
            mtu: self.mtu,
            num_queues: self.num_queues,
            container_mac: self.container_mac,
            families: Some(Families::of(&self.ips)),
        };
        let addrs = AddressRequest {
            ips: self.ips.clone(),
            routes: self.routes.clone(),
            allow_ip_forwarding: self.allow_ip_forwarding,
            skip_host_routes: self.skip_host_routes,
        };
        (veth, addrs)
    }
}

/// A veth pair built (by `build`) before the pod's addresses were known.
#[derive(Debug)]
pub struct PodLink {
    req: VethRequest,
    /// `None` when a link with the host-side name already existed: deleting it (upstream's
    /// "old hostVeth") waits until the addresses are there, so an ADD that fails in IPAM
    /// leaves it alone; the pair is then built by `finish`.
    made: Option<veth::Made>,
}

/// The first half of Calico's `DoNetworking`, run while IPAM allocates: the veth pair and
/// whatever of its set-up needs no address (`veth.rs`). A failure removes what it made.
pub async fn build(req: VethRequest) -> Result<PodLink> {
    tracing::info!("Setting the host side veth name to {}", req.host_veth);
    let host_ns = sys::current_thread_netns().map_err(DataplaneError::Netns)?;
    let r = req.clone();
    let made = on_thread("calico-veth", move || build_worker(&r, &host_ns)).await?;
    Ok(PodLink { req, made })
}

impl PodLink {
    /// The second half of `DoNetworking`, once the addresses are known. Unlike upstream, a
    /// failure removes the veth pair again: only what this call created, never an
    /// interface that was there before (a pod's running `eth0`, another call's veth).
    pub async fn finish(self, addrs: &AddressRequest) -> Result<NetworkingResult> {
        let host_ns = sys::current_thread_netns().map_err(DataplaneError::Netns)?;
        let addrs = addrs.clone();
        on_thread("calico-veth", move || {
            finish_worker(&self.req, self.made, &addrs, &host_ns)
        })
        .await
    }

    /// Removes what `build` made (the ADD failed in IPAM).
    pub async fn discard(self) -> Result<()> {
        match self.made {
            Some(m) => remove_created_interface(&self.req.netns_path, &self.req.ifname, m.cont_idx),
            None => Ok(()),
        }
    }
}

/// Calico's `DoNetworking` in one go (`build`, then `finish`), for callers outside a tokio
/// runtime: it runs on a scoped thread of its own.
pub fn do_networking(req: &NetworkingRequest) -> Result<NetworkingResult> {
    let (veth, addrs) = req.parts();
    std::thread::scope(|s| {
        s.spawn(|| block_on(async { build(veth).await?.finish(&addrs).await }).map_err(internal)?)
            .join()
            .unwrap_or_else(|_| Err(internal("dataplane thread panicked")))
    })
}

/// Runs `f` on a thread of its own and waits for it without blocking the runtime.
async fn on_thread<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = futures::channel::oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| internal(format!("failed to spawn a thread: {e}")))?;
    rx.await
        .unwrap_or_else(|_| Err(internal("dataplane worker thread panicked")))
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

/// Joins the host netns (the spawned thread inherits the caller's; joining it explicitly
/// makes sure the host socket and the host fd given to the kernel name the same namespace),
/// then runs `f` with a host handle on a runtime of this thread.
fn with_host<T>(host_ns: &std::fs::File, f: impl AsyncFnOnce(&Handle) -> Result<T>) -> Result<T> {
    sys::enter_netns(host_ns, "/proc/thread-self/ns/net").map_err(DataplaneError::Netns)?;
    block_on(async {
        let host = connect().map_err(|e| DataplaneError::HostHandle(e.to_string()))?;
        f(&host).await
    })
    .map_err(internal)?
}

/// Moves this (worker) thread into the pod netns and opens a netlink handle there; from then
/// on the thread's /proc/sys is the pod's. The thread exits when its work is done.
fn enter_pod(path: &str) -> Result<Handle> {
    let pod_ns = open_netns(path).map_err(|e| DataplaneError::Netns(e.into_message()))?;
    sys::enter_netns(&pod_ns, path).map_err(DataplaneError::Netns)?;
    connect().map_err(|e| internal(format!("failed to open netlink in netns: {e}")))
}

/// Body of `build`'s worker thread: starts in the host netns, ends in the pod netns.
fn build_worker(req: &VethRequest, host_ns: &std::fs::File) -> Result<Option<veth::Made>> {
    with_host(host_ns, async |host| {
        if veth::host_link_exists(host, &req.host_veth).await {
            tracing::info!(
                "A link named {} exists; it is replaced once the addresses are known.",
                req.host_veth
            );
            return Ok(None);
        }
        let pod = enter_pod(&req.netns_path)?;
        let cx = veth::Ctx {
            req,
            host_ns,
            host,
            pod: &pod,
        };
        veth::create(&cx, req.families).await.map(Some)
    })
}

/// Body of `finish`'s worker thread: starts in the host netns, ends in the pod netns.
fn finish_worker(
    req: &VethRequest,
    made: Option<veth::Made>,
    addrs: &AddressRequest,
    host_ns: &std::fs::File,
) -> Result<NetworkingResult> {
    with_host(host_ns, async |host| {
        if made.is_none() {
            veth::delete_old_host_link(host, &req.host_veth).await?;
        }
        let pod = enter_pod(&req.netns_path)?;
        let cx = veth::Ctx {
            req,
            host_ns,
            host,
            pod: &pod,
        };
        let made = match made {
            Some(m) => m,
            None => veth::create(&cx, None).await?,
        };
        veth::finish(&cx, made, addrs).await
    })
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
        let v4 = Families {
            v4: true,
            v6: false,
        };
        let err = veth::host_sysctls("calidoesnotexist", v4).unwrap_err();
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
