//! The host-wide IPAM lock: a blocking `flock` on `ipam_lock_file`, best-effort as upstream
//! (if the directory or lock cannot be had, log and go on unlocked).

use std::fs::{DirBuilder, OpenOptions};
use std::os::unix::fs::DirBuilderExt;
use std::path::Path;

use nix::fcntl::{Flock, FlockArg};
use tracing::{debug, warn};

/// Held while alive; dropping it unlocks.
pub struct IpamLock {
    _lock: Option<Flock<std::fs::File>>,
}

impl IpamLock {
    pub fn acquire(path: &str) -> IpamLock {
        if let Some(dir) = Path::new(path).parent() {
            if let Err(e) = DirBuilder::new().recursive(true).mode(0o777).create(dir) {
                warn!(path, error = %e, "cannot create the IPAM lock directory; continuing unlocked");
                return IpamLock { _lock: None };
            }
        }
        let file = match OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
        {
            Ok(f) => f,
            Err(e) => {
                warn!(path, error = %e, "cannot open the IPAM lock file; continuing unlocked");
                return IpamLock { _lock: None };
            }
        };
        match Flock::lock(file, FlockArg::LockExclusive) {
            Ok(l) => {
                debug!(path, "acquired IPAM lock");
                IpamLock { _lock: Some(l) }
            }
            Err((_, e)) => {
                warn!(path, error = %e, "cannot lock the IPAM lock file; continuing unlocked");
                IpamLock { _lock: None }
            }
        }
    }
}
