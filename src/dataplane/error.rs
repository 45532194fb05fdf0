//! The dataplane's errors: `DataplaneError`, with upstream's (Calico v3.32
//! `dataplane_linux.go`) texts, and the typed causes under it. Every OS or netlink failure
//! is kept as its source (`std::io::Error`, `nix::errno::Errno`, `rtnetlink::Error`, ...)
//! and rendered in `Display` as Go renders it (`file exists`,
//! `open <path>: no such file or directory`: `crate::support::gocompat`). String fields hold only
//! what has no cause under it: a name, a path, a value being reported, a finding.

use std::io;
use std::net::{IpAddr, Ipv6Addr};

use nix::errno::Errno;

use super::nl::nl_text;
use crate::support::gocompat::{errno_text, io_error_text, path_error};
use crate::support::net::IpNet;

#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A step of ADD asked for out of order (a bug: never expected).
    #[error("internal error: {0}")]
    Internal(&'static str),
    #[error("failed to create host netlink handle: {0}")]
    HostHandle(#[source] HostHandleError),
    #[error("failed to delete old hostVeth {name}: {}", nl_text(.source))]
    DeleteOldHostVeth {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// The pod netns could not be entered (containernetworking `ns` package texts).
    #[error("{0}")]
    Netns(#[source] NsError),
    /// The pod's netlink handle could not be opened.
    #[error("failed to open netlink in netns: {0}")]
    PodHandle(#[source] ThreadError),
    /// Creating the veth pair failed; upstream returns the bare netlink error.
    #[error("{}", nl_text(.0))]
    CreateVeth(#[source] rtnetlink::Error),
    #[error("failed to lookup {name:?}: {source}")]
    Lookup {
        name: String,
        #[source]
        source: LookupError,
    },
    #[error("timed out waiting for host veth {0:?} to accept MAC ee:ee:ee:ee:ee:ee")]
    MacTimeout(String),
    #[error("failed to disable DAD for {name}: {source}")]
    DisableDad {
        name: String,
        #[source]
        source: SysctlError,
    },
    /// `source` is e.g. `failed to set net.ipv4.conf.<h>.proxy_arp=1: <e>`.
    #[error("error configuring sysctls for interface: {iface}, error: {source}")]
    HostSysctls {
        iface: String,
        #[source]
        source: SetSysctlError,
    },
    #[error("failed to set {name:?} up: {}", nl_text(.source))]
    LinkUp {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    /// Upstream uses this text for both halves of the link-local "toggle" (down and up).
    #[error("failed to set {name:?} down: {}", nl_text(.source))]
    LinkDown {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to set container veth MAC to {mac} as requested via cni.projectcalico.org/hwAddr: {}", nl_text(.source))]
    ContainerMac {
        mac: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to add route inside the container: {}", nl_text(.0))]
    GatewayRoute(#[source] rtnetlink::Error),
    #[error("failed to add IPv{version} route for {dst} via {gw}: {}", nl_text(.source))]
    ContainerRoute {
        version: u8,
        dst: IpNet,
        gw: IpAddr,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("failed to set net.ipv6.conf.{conf}.disable_ipv6=0: {source}")]
    ContainerEnableIpv6 {
        conf: &'static str,
        #[source]
        source: SysctlError,
    },
    #[error("failed to get IPv6 addresses for host side of the veth pair")]
    NoHostIpv6,
    #[error("host-side veth got wrong link-local IP address: {0}")]
    WrongLinkLocal(Ipv6Addr),
    /// Upstream formats the whole Go link struct with `%q`; we print the interface name.
    #[error("failed to add IP addr to {name:?}: {}", nl_text(.source))]
    AddAddr {
        name: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("error configuring sysctls for the container netns, error: {0}")]
    ContainerSysctls(#[source] PodSysctlError),
    /// `source` is one of the `SetupRoutes` failures (`route (...) already exists for ...`),
    /// boxed: it is the largest cause.
    #[error("error adding host side routes for interface: {iface}, error: {source}")]
    HostRoutes {
        iface: String,
        #[source]
        source: Box<HostRouteError>,
    },
    #[error("failed to enter netns: {0}")]
    EnterNetns(#[source] NsError),
    #[error("failed to clean up workload's veth inside netns: {0}")]
    CleanUpLink(#[source] DelLinkError),
    #[error("timed out deleting device in netns {0}")]
    CleanUpTimeout(String),
    /// CHECK found the kernel different from the previous result (`check.rs`).
    #[error("CHECK: {0}")]
    Check(String),
    /// CHECK could not find a link (`what` names it: `host veth "cali..."`).
    #[error("CHECK: {what}: {source}")]
    CheckLink {
        what: String,
        #[source]
        source: LookupError,
    },
    /// CHECK could not list addresses or routes (`what`: `listing routes`).
    #[error("{what}: {}", nl_text(.source))]
    Dump {
        what: &'static str,
        #[source]
        source: rtnetlink::Error,
    },
    /// The HTTP/2 connection to the gRPC dataplane failed once made (`grpc.rs`).
    #[error("cannot connect to grpc dataplane at {target}: {source}")]
    GrpcConnect {
        target: String,
        #[source]
        source: tonic::transport::Error,
    },
    /// A gRPC request failed (or timed out), as grpc-go renders its status.
    #[error("rpc error: code = {} desc = {}", super::grpc::code_name(.0.code()), .0.message())]
    GrpcStatus(#[source] tonic::Status),
    /// The gRPC dataplane answered, unsuccessfully (its message).
    #[error("grpc dataplane error: {0}")]
    GrpcReply(String),
    /// The gRPC dataplane's container MAC (Go's `net.ParseMAC` text).
    #[error("address {0}: invalid MAC address")]
    GrpcMac(String),
    /// The call's deadline passed during a wait (`crate::support::deadline`).
    #[error(transparent)]
    Deadline(#[from] crate::support::deadline::Expired),
    /// Thread, task or runtime failures that have no upstream counterpart.
    #[error(transparent)]
    Thread(#[from] ThreadError),
}

/// Why the host side's netns or netlink socket could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum HostHandleError {
    #[error("Failed to open current namespace: {0}")]
    Netns(#[source] io::Error),
    #[error("{0}")]
    Netlink(#[source] io::Error),
}

/// Why a netns file could not be opened or entered (containernetworking `ns` texts).
#[derive(Debug, thiserror::Error)]
pub enum NsError {
    /// `statfs` failed; ENOENT is `ns.NSPathNotExistErr` (see `is_not_exist`).
    #[error("failed to Statfs {path:?}: {}", errno_text(*.source as i32))]
    Statfs {
        path: String,
        #[source]
        source: Errno,
    },
    /// Neither nsfs nor procfs: a leftover plain file under /run/netns, say.
    #[error("unknown FS magic on {path:?}: {magic:x}")]
    FsMagic { path: String, magic: u64 },
    #[error("{}", path_error("open", .path, .source))]
    Open {
        path: String,
        #[source]
        source: io::Error,
    },
    /// `setns` failed.
    #[error("error switching to ns {path}: Error switching to ns {path}: {}", errno_text(*.source as i32))]
    Enter {
        path: String,
        #[source]
        source: Errno,
    },
}

impl NsError {
    /// The path does not exist (`ns.NSPathNotExistErr`): DEL treats this as success.
    pub fn is_not_exist(&self) -> bool {
        matches!(
            self,
            NsError::Statfs {
                source: Errno::ENOENT,
                ..
            }
        )
    }
}

/// A `/proc/sys` file that could not be opened or written (Go's `*os.PathError` text).
#[derive(Debug, thiserror::Error)]
#[error("{}", path_error(.op, .path, .source))]
pub struct SysctlError {
    /// `open` or `write`.
    pub op: &'static str,
    pub path: String,
    #[source]
    pub source: io::Error,
}

/// One sysctl that could not be set: `failed to set net.ipv4.conf.<h>.proxy_arp=1: <e>`.
#[derive(Debug, thiserror::Error)]
#[error("failed to set {key}={value}: {source}")]
pub struct SetSysctlError {
    /// `net.ipv4.conf.<iface>.<name>`.
    pub key: String,
    pub value: &'static str,
    #[source]
    pub source: SysctlError,
}

/// A pod sysctl that could not be set: the write, or the trip into the pod netns.
#[derive(Debug, thiserror::Error)]
pub enum PodSysctlError {
    #[error(transparent)]
    Sysctl(#[from] SysctlError),
    #[error("{0}")]
    Thread(#[source] ThreadError),
}

/// A link looked up by name (vishvananda/netlink's texts).
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// `LinkNotFoundError`: the kernel said ENODEV.
    #[error("Link not found")]
    NotFound,
    #[error("{}", nl_text(.0))]
    Netlink(#[source] rtnetlink::Error),
}

/// `SetupRoutes`'s failures.
#[derive(Debug, thiserror::Error)]
pub enum HostRouteError {
    #[error("failed to add route (Ifindex: {index}, Dst: {dst}, Scope: link, Iface: {iface}): {}", nl_text(.source))]
    Add {
        index: u32,
        dst: IpNet,
        iface: String,
        #[source]
        source: rtnetlink::Error,
    },
    #[error("error listing routes: {}", nl_text(.0))]
    List(#[source] rtnetlink::Error),
    /// The destination is routed through another link; `conflict` describes that route.
    #[error("route (Ifindex: {index}, Dst: {dst}, Scope: link) already exists for an interface other than '{iface}': {conflict}")]
    Conflict {
        index: u32,
        dst: IpNet,
        iface: String,
        conflict: String,
    },
}

/// Why the blocking RTM_DELLINK failed.
#[derive(Debug, thiserror::Error)]
pub enum DelLinkError {
    /// The netlink socket itself.
    #[error("{}", io_error_text(.0))]
    Socket(#[source] io::Error),
    #[error("decoding a netlink answer: {0}")]
    Decode(#[source] rtnetlink::packet_core::DecodeError),
    /// The kernel's answer.
    #[error("{}", errno_text(*.0 as i32))]
    Kernel(#[source] Errno),
}

/// A thread, task or runtime of the dataplane's own that could not do its work.
#[derive(Debug, thiserror::Error)]
pub enum ThreadError {
    #[error("failed to spawn a thread: {0}")]
    Spawn(#[source] io::Error),
    #[error("failed to start a netlink runtime: {0}")]
    Runtime(#[source] io::Error),
    /// Duplicating a netns file descriptor, or opening a netlink socket.
    #[error("{0}")]
    Os(#[source] io::Error),
    /// A thread could not enter the pod netns.
    #[error("{0}")]
    Enter(#[source] NsError),
    /// `"netns"`, `"dataplane"`, ...: the thread's name in the text.
    #[error("{0} thread panicked")]
    Panicked(&'static str),
    /// A task of the call's runtime failed (`context`: what it was doing).
    #[error("{context}: {source}")]
    Task {
        context: &'static str,
        #[source]
        source: tokio::task::JoinError,
    },
}

/// A netlink error reply with `errno`, for tests that fake a dataplane.
#[cfg(test)]
pub(crate) fn netlink_errno(errno: i32) -> rtnetlink::Error {
    let mut m = rtnetlink::packet_core::ErrorMessage::default();
    m.code = std::num::NonZeroI32::new(-errno);
    rtnetlink::Error::NetlinkError(m)
}
