//! OS-level helpers: `/proc/sys` writes (read before write), entering network namespaces on
//! dedicated threads, and netlink connections.
//!
//! Upstream is Go, so its error strings embed Go's renderings of OS errors (`file exists`,
//! `open /proc/sys/...: no such file or directory`): `crate::support::gocompat` renders them.

use std::fs::{File, OpenOptions};
use std::future::Future;
use std::io;
use std::os::fd::AsFd;

use nix::sched::CloneFlags;
use nix::sys::statfs::{statfs, NSFS_MAGIC, PROC_SUPER_MAGIC};
use rtnetlink::Handle;

#[cfg(test)]
use super::ThreadError;
use super::{NsError, SysctlError};

/// Sets a sysctl through `/proc/sys`, unless it already holds `value` (read before write).
/// `/proc/sys/net` resolves against the network namespace of the *calling thread*, so the
/// caller must be on a thread inside the right netns.
pub(crate) fn set_sysctl(path: &str, value: &str) -> Result<(), SysctlError> {
    SysctlFile::open(path).set(value)
}

/// A `/proc/sys` file opened for reading and writing. The open file stays bound to the
/// netns of the thread that opened it, so it can be opened by a thread inside the pod netns
/// and set later from any thread; an open failure is reported by `set`, as a write would
/// have reported it.
#[derive(Debug)]
pub(crate) struct SysctlFile {
    path: String,
    file: Result<File, io::Error>,
}

impl SysctlFile {
    pub(crate) fn open(path: &str) -> SysctlFile {
        let file = OpenOptions::new().read(true).write(true).open(path);
        SysctlFile {
            path: path.to_string(),
            file,
        }
    }

    /// Writes `value` unless the sysctl holds it already (a value that cannot be read is
    /// written).
    pub(crate) fn set(&self, value: &str) -> Result<(), SysctlError> {
        use std::os::unix::fs::FileExt;

        let error = |op, source| SysctlError {
            op,
            path: self.path.clone(),
            source,
        };
        let file = self.file.as_ref().map_err(|e| error("open", copy_io(e)))?;
        let mut buf = [0u8; 64];
        if let Ok(n) = file.read_at(&mut buf, 0) {
            if buf[..n].trim_ascii() == value.as_bytes() {
                return Ok(());
            }
        }
        file.write_at(value.as_bytes(), 0)
            .map(|_| ())
            .map_err(|e| error("write", e))
    }
}

/// The same OS error again (`io::Error` is not `Clone`): an open failure is reported by
/// every `set`.
fn copy_io(e: &io::Error) -> io::Error {
    match e.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(e.kind(), e.to_string()),
    }
}

/// Opens a network namespace file after checking, like `ns.GetNS`, that it lives on nsfs or
/// procfs (a leftover plain file under /run/netns is rejected). A path that does not exist
/// is `NsError::is_not_exist`.
pub(crate) fn open_netns(path: &str) -> Result<File, NsError> {
    let st = statfs(path).map_err(|source| NsError::Statfs {
        path: path.to_string(),
        source,
    })?;
    let fs_type = st.filesystem_type();
    if fs_type != NSFS_MAGIC && fs_type != PROC_SUPER_MAGIC {
        // The field's width differs between libcs; `{:x}` prints the same digits.
        #[allow(clippy::unnecessary_cast)]
        let magic = fs_type.0 as u64;
        return Err(NsError::FsMagic {
            path: path.to_string(),
            magic,
        });
    }
    File::open(path).map_err(|source| NsError::Open {
        path: path.to_string(),
        source,
    })
}

/// Opens the network namespace of the calling thread (not the thread-group leader's, which
/// is what `/proc/self/ns/net` would give).
pub(crate) fn current_thread_netns() -> io::Result<File> {
    File::open("/proc/thread-self/ns/net")
}

/// Moves the calling thread into the network namespace `ns`. Only ever called on threads that
/// this module spawned and that exit when their work is done.
pub(crate) fn enter_netns(ns: &File, path: &str) -> Result<(), NsError> {
    nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(|source| NsError::Enter {
        path: path.to_string(),
        source,
    })
}

/// Runs `f` on a short-lived scoped thread that has joined the netns `ns`; the thread exits
/// afterwards, so no thread is ever left behind in that namespace. (Tests only: the plugin
/// goes through `netns::Netns`.)
#[cfg(test)]
pub(crate) fn run_in_netns<T: Send>(
    ns: &File,
    path: &str,
    f: impl FnOnce() -> T + Send,
) -> Result<T, ThreadError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            enter_netns(ns, path).map_err(ThreadError::Enter)?;
            Ok(f())
        })
        .join()
        .unwrap_or_else(|_| Err(ThreadError::Panicked("netns")))
    })
}

/// Builds a current-thread runtime on the calling (dedicated) thread and drives `fut` on it
/// (the blocking entry points used outside the plugin's own runtime).
pub(crate) fn block_on<F: Future>(fut: F) -> io::Result<F::Output> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    Ok(rt.block_on(fut))
}

/// Opens an rtnetlink connection bound to the netns the calling thread is in *now*; the socket
/// stays in that netns even if the thread moves later. Must be called inside a runtime.
pub(crate) fn connect() -> io::Result<Handle> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    tokio::spawn(conn);
    Ok(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_errors_match_go() {
        let err = set_sysctl("/nonexistent-dir/file", "1").unwrap_err();
        assert_eq!(err.source.kind(), io::ErrorKind::NotFound);
        assert_eq!(
            err.to_string(),
            "open /nonexistent-dir/file: no such file or directory"
        );
    }

    #[test]
    fn sysctl_files_write_only_what_differs() {
        let path = std::env::temp_dir().join(format!("calico-sysctl-{}", std::process::id()));
        std::fs::write(&path, "1\n").unwrap();
        let p = path.to_str().unwrap();
        let f = SysctlFile::open(p);
        // Already 1: not written (a write at 0 would leave "1\n" too, so look at the mtime).
        let before = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        f.set("1").unwrap();
        assert_eq!(
            std::fs::metadata(&path).unwrap().modified().unwrap(),
            before
        );
        f.set("0").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "0\n");
        std::fs::remove_file(&path).unwrap();
        // An open failure is reported by `set`, as Go's write would report it.
        let missing = SysctlFile::open("/proc/sys/net/ipv4/conf/calinotthere/forwarding");
        assert_eq!(
            missing.set("1").unwrap_err().to_string(),
            "open /proc/sys/net/ipv4/conf/calinotthere/forwarding: no such file or directory"
        );
    }

    #[test]
    fn netns_open_errors() {
        match open_netns("/nonexistent/netns/path") {
            Err(e) if e.is_not_exist() => assert_eq!(
                e.to_string(),
                "failed to Statfs \"/nonexistent/netns/path\": no such file or directory"
            ),
            other => panic!("unexpected {other:?}"),
        }
        // A directory that is neither nsfs nor procfs.
        match open_netns("/dev") {
            Err(e @ NsError::FsMagic { .. }) => {
                let m = e.to_string();
                assert!(m.starts_with("unknown FS magic on \"/dev\": "), "{m}")
            }
            other => panic!("unexpected {other:?}"),
        }
        // Our own netns file is fine.
        assert!(open_netns("/proc/thread-self/ns/net").is_ok());
    }
}
