//! One ADD per pod interface at a time on a node.
//!
//! Why. A runtime that retries an ADD while its first one still runs starts
//! two calls for one sandbox. Both find no endpoint, both get an address under the same
//! handle, and both build the same host veth (its name comes from the pod, or in cni mode
//! from the container ID): the second one finds the first one's veth and replaces it as
//! upstream replaces a stale "old hostVeth", and whichever endpoint write lands second either
//! fails (`resource already exists`; its undo then removes the veth it built, which by then
//! is the pod's only interface) or, re-networking the endpoint it found, overwrites the first
//! call's result. Either way one call reports a result the pod does not have. Nothing in the
//! datastore can tell the two calls apart (same container, same handle), and a veth left by
//! a finished or crashed ADD must still be replaced, so the calls have to be kept apart
//! before either touches anything.
//!
//! How. ADD holds, for its whole run (undo included), an exclusive lock named by the host
//! veth: a one-byte open-file-description lock (`F_OFD_SETLK`) at an offset hashed from
//! that name, in one node-wide file beside the IPAM lock (`sandbox.lock`). One file, so
//! nothing accumulates per pod; the kernel drops the lock when the process exits, however it
//! exits, so a crashed or killed ADD never blocks the next one. The lock is only tried: an
//! ADD that finds it held fails at once with CNI code 11 ("try again later"), having only
//! connected (no datastore object read or written, nothing built), and the runtime retries it
//! once the first call is done. (Waiting
//! for the first call instead would not help: after it, the second call is a re-ADD, which
//! in k8s mode re-networks the pod with new addresses, as upstream does, and would leave the
//! first call's reported result stale.) Sequential ADDs never meet the lock, so upstream's
//! observable behaviour is unchanged; only two overlapping ADDs of one pod interface (or of two
//! sandboxes that would share one host veth) are told apart.
//!
//! Keyed by the host veth rather than the container ID because the veth is what the calls
//! fight over: it also keeps apart two sandboxes of one pod (k8s mode names the veth after the
//! pod), which share the endpoint and the veth in the same way. A hash collision between two
//! names (62 bits) would only make one ADD retry.
//!
//! Both datastores need it: the veth is node-local, and on the Kubernetes datastore the
//! endpoint write is a patch of the pod, which the later call wins silently.
//!
//! Best effort as the IPAM lock: if the file cannot be opened or the kernel has no OFD locks,
//! the call logs it and goes on unlocked.
//!
//! DEL does not take it: a DEL must never be refused, and a DEL of an old sandbox of a pod
//! may legitimately run while the pod's new sandbox is being added (same host veth in k8s
//! mode), which a DEL holding the lock would make fail. A DEL racing an ADD of the very same
//! sandbox is left as upstream has it.

use std::fs::File;
use std::path::Path;

use nix::errno::Errno;
use nix::fcntl::{fcntl, FcntlArg};
use tracing::{debug, warn};

use crate::error::{Error, Result};
use crate::ipam::lock::{create_dirs, open_lock_file};

/// The lock file's name, in the IPAM lock file's directory.
const FILE_NAME: &str = "sandbox.lock";

/// Held while alive: closing the file releases the lock.
#[derive(Debug)]
pub struct SandboxLock {
    _file: Option<File>,
}

impl SandboxLock {
    /// Takes the lock for `host_veth` in the directory of `ipam_lock_file`, without waiting:
    /// held by another call, it is this call's error (code 11).
    pub fn try_acquire(ipam_lock_file: &str, host_veth: &str) -> Result<SandboxLock> {
        let path = Path::new(ipam_lock_file).with_file_name(FILE_NAME);
        let unlocked = SandboxLock { _file: None };
        let file = match create_dirs(path.parent()).and_then(|()| open_lock_file(&path)) {
            Ok(f) => f,
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot open the sandbox lock file; continuing unlocked");
                return Ok(unlocked);
            }
        };
        let range = byte_range(offset(host_veth));
        match fcntl(&file, FcntlArg::F_OFD_SETLK(&range)) {
            Ok(_) => {
                debug!(host_veth, "took the sandbox lock");
                Ok(SandboxLock { _file: Some(file) })
            }
            Err(Errno::EAGAIN | Errno::EACCES) => Err(Error::SandboxBusy {
                host_veth: host_veth.to_string(),
            }),
            Err(e) => {
                warn!(host_veth, error = %e, "cannot take the sandbox lock; continuing unlocked");
                Ok(unlocked)
            }
        }
    }
}

/// The lock's offset for `name`: 64-bit FNV-1a, cut to 62 bits (a positive `off_t`).
fn offset(name: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // The mask keeps the value below 2^62, so it always fits.
    i64::try_from(h & ((1 << 62) - 1)).unwrap_or(0)
}

/// An exclusive lock on the one byte at `start`.
fn byte_range(start: i64) -> libc::flock {
    // SAFETY: `flock` is a plain C struct of integers, for which all-zero is a valid value
    // (and the kernel requires `l_pid` to be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = libc::F_WRLCK as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    fl.l_start = start;
    fl.l_len = 1;
    fl
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skel::error::CODE_TRY_AGAIN_LATER;
    use crate::skel::CniError;

    fn scratch(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("sandboxlock-{name}-{}", std::process::id()))
    }

    #[test]
    fn one_holder_per_veth() {
        let dir = scratch("one");
        let ipam = dir.join("sub").join("ipam.lock");
        let ipam = ipam.to_str().unwrap();
        let first = SandboxLock::try_acquire(ipam, "cali0123456789a").unwrap();
        assert!(first._file.is_some());
        assert!(dir.join("sub").join(FILE_NAME).exists());
        // Held (by another open file description, as another process would): refused.
        let e = CniError::from(SandboxLock::try_acquire(ipam, "cali0123456789a").unwrap_err());
        assert_eq!(e.code, CODE_TRY_AGAIN_LATER);
        assert!(e.msg.contains("cali0123456789a"), "{}", e.msg);
        // Another veth is not held up.
        let other = SandboxLock::try_acquire(ipam, "cali0123456789b").unwrap();
        assert!(other._file.is_some());
        // Released with its holder.
        drop(first);
        assert!(SandboxLock::try_acquire(ipam, "cali0123456789a").is_ok());
        drop(other);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn offsets_are_stable_and_positive() {
        // FNV-1a of "" is the offset basis; the values must not change between versions,
        // or an upgraded binary would not see an older one's lock.
        assert_eq!(
            offset(""),
            (0xcbf2_9ce4_8422_2325u64 & ((1 << 62) - 1)) as i64
        );
        assert_eq!(
            offset("a"),
            (0xaf63_dc4c_8601_ec8cu64 & ((1 << 62) - 1)) as i64
        );
        assert!(offset("cali0123456789a") >= 0);
        assert_ne!(offset("cali0123456789a"), offset("cali0123456789b"));
    }

    #[test]
    fn an_unusable_directory_goes_on_unlocked() {
        let lock = SandboxLock::try_acquire("/proc/no/such/ipam.lock", "cali1").unwrap();
        assert!(lock._file.is_none());
    }
}
