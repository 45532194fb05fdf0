//! The dataplanes: the `Dataplane` trait (upstream's `pkg/dataplane`), picked once per call
//! by `Selected::pick`, with the Linux one here and the gRPC one in `grpc.rs`.
//!
//! The Linux dataplane: veth pair, MACs, addresses, routes and sysctls inside and outside the
//! pod's network namespace. Entry points: `Linux::build` then `VethPair::finish` (ADD, in
//! two parts so that the first runs while IPAM allocates; `veth.rs`), `start_clean_up` /
//! `clean_up_namespace` (DEL), `check::verify` (CHECK).
//!
//! Threading model (`netns.rs`). A call opens one netlink handle per side and drives both
//! from its own (current-thread) runtime; the async functions here must run on it:
//! * the "host" netns is whatever netns the *calling thread* is in (`/proc/thread-self/ns/net`),
//!   and host-side sysctls are written from that thread;
//! * the pod handle is opened by a short-lived thread that entered the pod netns (a netlink
//!   socket stays bound to the netns it was created in), which exits right after; pod
//!   sysctls that name the new interface take one more such trip (IPv6 only);
//! * deleting a link (DEL, and undoing an ADD) runs on a thread of its own, bounded;
//! * no thread is ever left in the pod netns: each exits when its work is done.
//!
//! Every wait here (the MAC read-back, the link-local retry, the bounded netns deletion) also
//! ends at the call's deadline (`crate::support::deadline`).

pub mod check;
mod error;
pub mod grpc;
pub mod link_watch;
mod netns;
mod nl;
mod route;
mod sys;
mod veth;

use std::net::{Ipv4Addr, Ipv6Addr};
use std::time::Duration;

use crate::support::net::IpNet;
use netns::{Netns, OpenError, Target};
use sys::{block_on, connect, open_netns};

#[cfg(test)]
pub(crate) use error::netlink_errno;
pub use error::{
    DataplaneError, DelLinkError, HostHandleError, HostRouteError, LookupError, NsError,
    PodSysctlError, SetSysctlError, SysctlError, ThreadError,
};
pub use netns::Teardown;

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetworkingResult {
    pub host_veth: String,
    /// Lower-case `aa:bb:cc:dd:ee:ff`.
    pub container_mac: String,
    /// The ifindex of the container end this call created (see `remove_created_interface`).
    pub container_index: u32,
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

/// What `Dataplane::build` makes of a pod's interface: everything that needs no address.
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

/// What `PodInterface::finish` adds to a pod's interface: everything that needs the
/// addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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

/// Upstream's `Dataplane` (cni-plugin/pkg/dataplane): what builds a pod's interface. ADD's
/// `DoNetworking` is split around IPAM: `build` runs while IPAM allocates, the interface it
/// returns is finished once the addresses are known, or removed when the ADD fails. The
/// call's dataplane is picked once by `Selected::pick` (upstream's `GetDataplane`); DEL's
/// `CleanUpNamespace` is `CleanUp::start`. Single-threaded runtime: no `Send`.
#[allow(async_fn_in_trait)]
pub trait Dataplane {
    type Interface: PodInterface;
    /// What needs no address (the Linux veth pair; nothing for the gRPC agent). A failure
    /// removes what it made.
    async fn build(self, req: VethRequest) -> Result<Self::Interface>;
}

/// A pod interface being made by one ADD.
#[allow(async_fn_in_trait)]
pub trait PodInterface: Sized {
    /// Whether ADD's result gives the pod's addresses as host networks (/32, /128), as this
    /// dataplane puts them on the interface: upstream's Linux dataplane narrows IPAM's
    /// addresses so. Its gRPC dataplane does not, and its result keeps IPAM's prefix.
    fn result_has_host_addresses(&self) -> bool {
        true
    }
    /// The rest of `DoNetworking`, once the addresses are known (`pod`: what a dataplane
    /// may be told besides). Unlike upstream, a failure removes what this call made.
    async fn finish(
        &mut self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> Result<NetworkingResult>;
    /// Undoes this call's interface (the ADD failed after all): only what it made.
    async fn remove(self) -> Result<()>;
    /// The container end's MAC that `finish` will report for `addrs`, when it is known
    /// before (lower-case): the endpoint can then be written while `finish` runs. `None`
    /// when only `finish` can tell.
    fn known_mac(&self, _addrs: &AddressRequest) -> Option<String> {
        None
    }
}

/// What the gRPC dataplane is told about the pod besides the interface's names and
/// addresses (the Linux dataplane needs none of it).
#[derive(Clone, Copy, Debug)]
pub struct PodFacts<'a> {
    /// IPAM's addresses as it gave them (prefix and gateway included).
    pub ips: &'a [crate::skel::result::IpConfig],
    /// The WorkloadEndpoint as it will be written.
    pub endpoint: &'a crate::datastore::model::WorkloadEndpoint,
    /// The pod's annotations (none outside Kubernetes' `policy.type: k8s`).
    pub annotations: &'a std::collections::BTreeMap<String, String>,
}

/// The Linux dataplane of one ADD: its netlink handles on both sides (`netns.rs`), being
/// opened ahead of their use. Opening them creates nothing, so ADD starts it while its first
/// datastore round trip is under way; a failure to open them is `build`'s error.
pub struct Linux {
    handles: tokio::task::JoinHandle<Result<Netns>>,
}

impl Linux {
    /// Starts opening the handles for the pod netns at `netns_path`, and the pod's
    /// forwarding sysctls of the `expected` families (either, when unknown), as a task of
    /// the call's runtime. Must be called on that runtime, from a thread in the host netns.
    pub fn open(netns_path: String, expected: Option<Families>) -> Linux {
        let forwarding = expected.unwrap_or(Families { v4: true, v6: true });
        let handles = tokio::spawn(async move {
            let pod_ns = open_netns(&netns_path).map_err(DataplaneError::Netns)?;
            Netns::open(&netns_path, pod_ns, forwarding)
                .await
                .map_err(|e| match e {
                    OpenError::Host(e) => DataplaneError::HostHandle(e),
                    OpenError::Enter(e) => DataplaneError::Netns(e),
                    OpenError::Pod(e) => DataplaneError::PodHandle(e),
                })
        });
        Linux { handles }
    }
}

impl Dataplane for Linux {
    type Interface = VethPair;

    /// The first half of Calico's `DoNetworking`: the veth pair and whatever of its set-up
    /// needs no address (`veth.rs`). Must run on the call's runtime, from a thread in the
    /// host netns.
    async fn build(self, req: VethRequest) -> Result<VethPair> {
        let ns = self.handles.await.map_err(|source| ThreadError::Task {
            context: "opening the netlink handles",
            source,
        })??;
        VethPair::build(ns, req).await
    }
}

/// A veth pair built before the pod's addresses were known, with the call's handles on
/// both sides.
pub struct VethPair {
    req: VethRequest,
    ns: Netns,
    /// What this call made. `None` when a link with the host-side name already existed:
    /// deleting it (upstream's "old hostVeth") waits until the addresses are there, so an ADD
    /// that fails in IPAM leaves it alone; `finish` builds the pair then. Also `None` once a
    /// failure has removed the pair.
    made: Option<veth::Made>,
}

impl VethPair {
    /// The pair for `req` with the call's handles; none yet when a link with its host-side
    /// name exists (see `made`).
    async fn build(ns: Netns, req: VethRequest) -> Result<VethPair> {
        tracing::info!("Setting the host side veth name to {}", req.host_veth);
        if veth::host_link_exists(&ns.host, &req.host_veth).await {
            tracing::info!(
                "A link named {} exists; it is replaced once the addresses are known.",
                req.host_veth
            );
            return Ok(VethPair {
                req,
                ns,
                made: None,
            });
        }
        let cx = veth::Ctx { req: &req, ns: &ns };
        let made = veth::create(&cx, req.families).await?;
        Ok(VethPair {
            req,
            ns,
            made: Some(made),
        })
    }

    /// `PodInterface::finish`, which needs nothing of the pod on Linux. Never removes an
    /// interface that was there before (a pod's running `eth0`, another call's veth).
    async fn finish_addresses(&mut self, addrs: &AddressRequest) -> Result<NetworkingResult> {
        let cx = veth::Ctx {
            req: &self.req,
            ns: &self.ns,
        };
        let mut made = match self.made.take() {
            Some(m) => m,
            None => {
                veth::delete_old_host_link(&self.ns.host, &self.req.host_veth).await?;
                veth::create(&cx, None).await?
            }
        };
        let net = veth::finish(&cx, &mut made, addrs).await?;
        self.made = Some(made);
        Ok(net)
    }
}

impl PodInterface for VethPair {
    async fn finish(
        &mut self,
        addrs: &AddressRequest,
        _pod: &PodFacts<'_>,
    ) -> Result<NetworkingResult> {
        self.finish_addresses(addrs).await
    }

    /// Removes the pair if it is still there: deleting the container end by its ifindex
    /// takes the host end and its routes with it; an interface that replaced it meanwhile
    /// is left alone.
    async fn remove(self) -> Result<()> {
        let Some(made) = self.made else {
            return Ok(());
        };
        tracing::info!(
            netns = self.req.netns_path,
            iface = self.req.ifname,
            index = made.cont_idx,
            "Removing the interface this call created."
        );
        let cx = veth::Ctx {
            req: &self.req,
            ns: &self.ns,
        };
        veth::remove_pair(&cx, made.cont_idx).await
    }

    /// Known once the pair is up for the addresses' families (`build` with the families
    /// the configuration tells): `finish` then adds addresses and routes only.
    fn known_mac(&self, addrs: &AddressRequest) -> Option<String> {
        let made = self.made.as_ref()?;
        veth::known_mac(made, Families::of(&addrs.ips))
    }
}

/// The dataplane of one call, picked once (upstream's `GetDataplane`).
pub enum Selected {
    Linux(Linux),
    Grpc(grpc::GrpcDataplane),
}

impl Selected {
    /// The gRPC dataplane when the NetConf chose it, else the Linux one (its handles start
    /// opening now: see `Linux::open`).
    pub fn pick(
        grpc: Option<grpc::GrpcDataplane>,
        netns_path: String,
        expected: Option<Families>,
    ) -> Selected {
        match grpc {
            Some(dp) => Selected::Grpc(dp),
            None => Selected::Linux(Linux::open(netns_path, expected)),
        }
    }
}

/// The interface of either dataplane.
pub enum AnyInterface {
    Linux(VethPair),
    Grpc(grpc::AgentInterface),
}

impl Dataplane for Selected {
    type Interface = AnyInterface;

    async fn build(self, req: VethRequest) -> Result<AnyInterface> {
        match self {
            Selected::Linux(l) => l.build(req).await.map(AnyInterface::Linux),
            Selected::Grpc(g) => g.build(req).await.map(AnyInterface::Grpc),
        }
    }
}

impl PodInterface for AnyInterface {
    async fn finish(
        &mut self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> Result<NetworkingResult> {
        match self {
            AnyInterface::Linux(l) => l.finish(addrs, pod).await,
            AnyInterface::Grpc(g) => g.finish(addrs, pod).await,
        }
    }

    async fn remove(self) -> Result<()> {
        match self {
            AnyInterface::Linux(l) => l.remove().await,
            AnyInterface::Grpc(g) => g.remove().await,
        }
    }

    fn known_mac(&self, addrs: &AddressRequest) -> Option<String> {
        match self {
            AnyInterface::Linux(l) => l.known_mac(addrs),
            AnyInterface::Grpc(g) => g.known_mac(addrs),
        }
    }

    fn result_has_host_addresses(&self) -> bool {
        match self {
            AnyInterface::Linux(l) => l.result_has_host_addresses(),
            AnyInterface::Grpc(g) => g.result_has_host_addresses(),
        }
    }
}

/// DEL's removal of the pod's interface, started at once: the kernel's on a thread of its
/// own (`start_clean_up`), or the gRPC agent's Del as a task of the call's runtime.
pub enum CleanUp {
    Linux(Teardown),
    Grpc(tokio::task::JoinHandle<Result<()>>),
}

impl CleanUp {
    /// Calico's `CleanUpNamespace` of the call's dataplane, started.
    pub fn start(grpc: Option<grpc::GrpcDataplane>, netns_path: &str, ifname: &str) -> CleanUp {
        match grpc {
            Some(dp) => {
                let (ifname, netns) = (ifname.to_string(), netns_path.to_string());
                CleanUp::Grpc(tokio::spawn(async move { dp.del(&ifname, &netns).await }))
            }
            None => CleanUp::Linux(start_clean_up(netns_path, ifname)),
        }
    }

    /// Waits for the removal and gives its outcome.
    pub async fn finish(self) -> Result<()> {
        match self {
            CleanUp::Linux(t) => t.finish().await,
            CleanUp::Grpc(task) => task.await.map_err(|source| ThreadError::Task {
                context: "the gRPC Del task failed",
                source,
            })?,
        }
    }
}

/// Calico's `CleanUpNamespace` started: deletes `ifname` inside the pod netns (which removes
/// the host end and its routes) on a thread of its own, at once; `Teardown::finish` waits
/// for it (bounded by 20 s and the call's deadline). A missing netns or interface is
/// success.
pub fn start_clean_up(netns_path: &str, ifname: &str) -> Teardown {
    if netns_path.is_empty() {
        tracing::info!("CleanUpNamespace called with no netns name, ignoring.");
        return Teardown::done();
    }
    tracing::info!(
        netns = netns_path,
        iface = ifname,
        "Deleting workload's device in netns."
    );
    netns::start_delete(Target::Path, netns_path, ifname, 0)
}

/// `start_clean_up` and its outcome, for callers outside a tokio runtime.
pub fn clean_up_namespace(netns_path: &str, ifname: &str) -> Result<()> {
    std::thread::scope(|s| {
        s.spawn(|| {
            block_on(start_clean_up(netns_path, ifname).finish()).map_err(ThreadError::Runtime)?
        })
        .join()
        .unwrap_or_else(|_| Err(ThreadError::Panicked("netns cleanup").into()))
    })
}

/// Whether a link with this name exists in the calling thread's netns.
pub fn host_link_exists(name: &str) -> Result<bool> {
    std::thread::scope(|s| {
        s.spawn(|| {
            block_on(async {
                let h = connect()
                    .map_err(|e| DataplaneError::HostHandle(HostHandleError::Netlink(e)))?;
                nl::link_by_name(&h, name)
                    .await
                    .map(|l| l.is_some())
                    .map_err(|e| DataplaneError::Lookup {
                        name: name.to_string(),
                        source: LookupError::Netlink(e),
                    })
            })
            .map_err(ThreadError::Runtime)?
        })
        .join()
        .unwrap_or_else(|_| Err(ThreadError::Panicked("netlink").into()))
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
            source: SetSysctlError {
                key: "net.ipv4.conf.cali1.proxy_arp".into(),
                value: "1",
                source: SysctlError {
                    op: "open",
                    path: "/x".into(),
                    source: std::io::Error::from_raw_os_error(libc::EACCES),
                },
            },
        };
        assert_eq!(
            e.to_string(),
            "error configuring sysctls for interface: cali1, error: failed to set \
             net.ipv4.conf.cali1.proxy_arp=1: open /x: permission denied"
        );
        let e = DataplaneError::ContainerRoute {
            version: 4,
            dst: "0.0.0.0/0".parse().unwrap(),
            gw: std::net::IpAddr::V4(IPV4_GATEWAY),
            source: netlink_errno(libc::EEXIST),
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
                source: netlink_errno(libc::ENODEV),
            }
            .to_string(),
            "failed to set \"eth0\" up: no such device"
        );
        // The cause is kept with its type, under the same text.
        let e = DataplaneError::CreateVeth(netlink_errno(libc::EEXIST));
        assert_eq!(e.to_string(), "file exists");
        let source = std::error::Error::source(&e).and_then(|s| s.downcast_ref());
        assert!(matches!(source, Some(rtnetlink::Error::NetlinkError(_))));
        let e = DataplaneError::CleanUpLink(DelLinkError::Kernel(nix::errno::Errno::EBUSY));
        assert_eq!(
            e.to_string(),
            "failed to clean up workload's veth inside netns: device or resource busy"
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
        assert_eq!(err.source.source.kind(), std::io::ErrorKind::NotFound);
        assert_eq!(
            err.to_string(),
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
