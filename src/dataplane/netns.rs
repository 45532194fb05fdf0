//! Running netlink work inside a network namespace. A netlink socket belongs to the netns of
//! the thread that created it, so each piece of work runs on a short-lived scoped thread
//! that joins the namespace (setns), opens its own socket on its own current-thread runtime,
//! works and exits. No thread ever goes back, so none can be left in a pod's netns.

use std::fs::File;
use std::future::Future;
use std::os::fd::AsFd;

use rtnetlink::Handle;

use super::DataplaneError;

/// Runs `f` with a netlink handle in `netns` (None: the caller's own netns).
pub fn run_in<T, F, Fut>(netns: Option<&File>, f: F) -> Result<T, DataplaneError>
where
    T: Send,
    F: FnOnce(Handle) -> Fut + Send,
    Fut: Future<Output = Result<T, DataplaneError>>,
{
    std::thread::scope(|s| {
        s.spawn(move || {
            if let Some(ns) = netns {
                nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| DataplaneError::EnterNetns(e.to_string()))?;
            }
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| DataplaneError::Netlink(format!("runtime: {e}")))?;
            rt.block_on(async move {
                let (conn, handle, _) = rtnetlink::new_connection()
                    .map_err(|e| DataplaneError::Netlink(format!("netlink socket: {e}")))?;
                tokio::spawn(conn);
                f(handle).await
            })
        })
        .join()
        .map_err(|_| DataplaneError::Netlink("netlink worker thread panicked".into()))?
    })
}

/// The calling thread's own network namespace.
pub fn current() -> Result<File, DataplaneError> {
    File::open("/proc/thread-self/ns/net")
        .map_err(|e| DataplaneError::EnterNetns(format!("open own netns: {e}")))
}
