//! One call's handles on the two network namespaces, opened once and driven from the call's
//! own runtime (no runtime or worker thread of their own):
//! * host side: the calling thread's netns (the plugin's main thread). Its netlink socket is
//!   opened right there, and host sysctls are written from that thread;
//! * pod side: a short-lived thread enters the pod netns, opens the netlink socket there
//!   (registered with the caller's runtime) and the pod's forwarding sysctl files, and exits;
//!   socket and files stay bound to the pod netns. Sysctls of an interface created later
//!   need a thread in the pod netns again (`in_pod`): /proc/sys/net resolves per thread;
//! * deleting a link runs on a thread of its own (`start_delete`): the kernel tears the
//!   device down inside the request (~15 ms; without end when a device stays referenced),
//!   which must neither hold up the runtime nor outlast the call's deadline.

use std::fs::File;
use std::io;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use rtnetlink::Handle;

use super::sys::{self, open_netns, SysctlFile};
use super::{nl, DataplaneError, Families, HostHandleError, NsError, Result, ThreadError};

/// How long a link deletion may take (and the call's deadline).
const DELETE_TIMEOUT: Duration = Duration::from_secs(20);

/// The two sides of one call.
pub(crate) struct Netns {
    /// The pod netns path (`CNI_NETNS`), for messages.
    pub path: String,
    /// The host netns (the caller's): the veth's peer is placed there.
    pub host_ns: File,
    pub pod_ns: File,
    pub host: Handle,
    pub pod: Handle,
    /// The pod's `net.ipv4.ip_forward` and `net.ipv6.conf.all.forwarding`, opened inside the
    /// pod netns for the families asked for.
    pub forwarding_v4: Option<SysctlFile>,
    pub forwarding_v6: Option<SysctlFile>,
}

/// Why `Netns::open` failed; each caller words it its own way.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// The host netns or its netlink socket.
    Host(HostHandleError),
    /// Entering the pod netns.
    Enter(NsError),
    /// The pod's netlink socket, or the thread that opens it.
    Pod(ThreadError),
}

impl Netns {
    /// Opens both handles; must be called on the runtime that will drive them, from a thread
    /// in the host netns. `forwarding`: which forwarding sysctls of the pod to open.
    pub async fn open(path: &str, pod_ns: File, forwarding: Families) -> Result<Netns, OpenError> {
        let host_ns =
            sys::current_thread_netns().map_err(|e| OpenError::Host(HostHandleError::Netns(e)))?;
        let host = sys::connect().map_err(|e| OpenError::Host(HostHandleError::Netlink(e)))?;
        let runtime = tokio::runtime::Handle::current();
        let ns = pod_ns
            .try_clone()
            .map_err(|e| OpenError::Pod(ThreadError::Os(e)))?;
        let p = path.to_string();
        let opened = spawn("calico-netns", move || {
            sys::enter_netns(&ns, &p).map_err(OpenError::Enter)?;
            // The socket registers with the caller's runtime, which drives it from now on.
            let _runtime = runtime.enter();
            let (conn, pod, _) =
                rtnetlink::new_connection().map_err(|e| OpenError::Pod(ThreadError::Os(e)))?;
            let v4 = forwarding
                .v4
                .then(|| SysctlFile::open("/proc/sys/net/ipv4/ip_forward"));
            let v6 = forwarding
                .v6
                .then(|| SysctlFile::open("/proc/sys/net/ipv6/conf/all/forwarding"));
            Ok((conn, pod, v4, v6))
        })
        .map_err(|e| OpenError::Pod(ThreadError::Spawn(e)))?;
        let (conn, pod, forwarding_v4, forwarding_v6) = opened
            .await
            .unwrap_or_else(|_| Err(OpenError::Pod(ThreadError::Panicked("netns"))))?;
        tokio::spawn(conn);
        Ok(Netns {
            path: path.to_string(),
            host_ns,
            pod_ns,
            host,
            pod,
            forwarding_v4,
            forwarding_v6,
        })
    }

    /// Runs `f` on a short-lived thread inside the pod netns.
    pub async fn in_pod<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Result<T, ThreadError> {
        let ns = self.pod_ns.try_clone().map_err(ThreadError::Os)?;
        let path = self.path.clone();
        let done = spawn("calico-netns", move || {
            sys::enter_netns(&ns, &path).map_err(ThreadError::Enter)?;
            Ok(f())
        })
        .map_err(ThreadError::Spawn)?;
        done.await
            .unwrap_or_else(|_| Err(ThreadError::Panicked("netns")))
    }

    /// Starts deleting the link with ifindex `index` (`ifname` for messages) in the pod netns.
    pub fn start_delete(&self, ifname: &str, index: u32) -> Teardown {
        match self.pod_ns.try_clone() {
            Ok(ns) => start_delete(Target::Open(ns), &self.path, ifname, index),
            Err(e) => Teardown::failed(ThreadError::Os(e).into()),
        }
    }
}

/// The netns a deletion runs in.
pub(crate) enum Target {
    /// Opened by the deleting thread; a path that does not exist is nothing to do.
    Path,
    Open(File),
}

/// Starts deleting `ifname` (or, with a non-zero `index`, the link with that ifindex) in the
/// netns `target` at `path`, on a thread of its own; `Teardown::finish` gives the outcome.
pub(crate) fn start_delete(target: Target, path: &str, ifname: &str, index: u32) -> Teardown {
    let (p, name) = (path.to_string(), ifname.to_string());
    match spawn("calico-netns-del", move || delete(target, &p, &name, index)) {
        Ok(rx) => Teardown {
            started: Instant::now(),
            path: path.to_string(),
            ifname: ifname.to_string(),
            state: State::Running(rx),
        },
        Err(e) => Teardown::failed(ThreadError::Spawn(e).into()),
    }
}

/// A link deletion running on its own thread.
#[derive(Debug)]
pub struct Teardown {
    started: Instant,
    path: String,
    ifname: String,
    state: State,
}

#[derive(Debug)]
enum State {
    Done(Result<()>),
    Running(oneshot::Receiver<Result<()>>),
}

impl Teardown {
    pub(crate) fn done() -> Teardown {
        Teardown {
            started: Instant::now(),
            path: String::new(),
            ifname: String::new(),
            state: State::Done(Ok(())),
        }
    }

    fn failed(e: DataplaneError) -> Teardown {
        Teardown {
            state: State::Done(Err(e)),
            ..Teardown::done()
        }
    }

    /// The deletion's outcome, waited for until 20 s after its start or the call's limit;
    /// on timeout the thread is abandoned (the process is about to exit anyway).
    pub async fn finish(self) -> Result<()> {
        let rx = match self.state {
            State::Done(r) => return r,
            State::Running(rx) => rx,
        };
        let left = DELETE_TIMEOUT.saturating_sub(self.started.elapsed());
        let (until, capped) = crate::support::deadline::cap_at(left);
        match tokio::time::timeout_at(until, rx).await {
            Ok(Ok(r)) => {
                if r.is_ok() {
                    tracing::info!(after = ?self.started.elapsed(), "Deleted device in netns.");
                }
                r
            }
            Ok(Err(_)) => Err(ThreadError::Panicked("netns cleanup").into()),
            Err(_) if capped => Err(crate::support::deadline::expired(format!(
                "deleting device {:?} in netns {}",
                self.ifname, self.path
            ))
            .into()),
            Err(_) => Err(DataplaneError::CleanUpTimeout(self.path)),
        }
    }
}

/// Body of a deleting thread.
fn delete(target: Target, path: &str, ifname: &str, index: u32) -> Result<()> {
    let ns = match target {
        Target::Open(f) => f,
        Target::Path => match open_netns(path) {
            Ok(f) => f,
            Err(e) if e.is_not_exist() => {
                tracing::info!("Workload's netns already gone.  Nothing to do.");
                return Ok(());
            }
            Err(e) => return Err(DataplaneError::EnterNetns(e)),
        },
    };
    sys::enter_netns(&ns, path).map_err(DataplaneError::EnterNetns)?;
    match nl::del_link_blocking(ifname, index) {
        Ok(true) => Ok(()),
        Ok(false) if index == 0 => {
            tracing::info!("Workload's veth was already gone.  Nothing to do.");
            Ok(())
        }
        Ok(false) => {
            tracing::info!("The interface this call created is already gone.");
            Ok(())
        }
        Err(e) => Err(DataplaneError::CleanUpLink(e)),
    }
}

/// Runs `f` on a new thread; its value arrives on the receiver (dropped unsent if `f`
/// panics).
fn spawn<T: Send + 'static>(
    name: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> io::Result<oneshot::Receiver<T>> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let _ = tx.send(f());
        })?;
    Ok(rx)
}
