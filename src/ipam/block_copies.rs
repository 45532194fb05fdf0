//! The blocks this host's IPAM lock holders last wrote, as written (value and revision), one
//! file per block beside the lock file (`<lock file>.block.<cidr>`, 0600), written and read
//! only by the lock's holder.
//!
//! The next holder takes such a copy for the block instead of reading it: on a node, the
//! block an ADD assigns from is nearly always the one the previous ADD or DEL on that node
//! wrote, and its read is a quorum read of etcd made while every other call on the node
//! waits for the lock. A copy is no more trusted than a read: the write that follows it is
//! a compare-and-swap on its revision, so a copy someone else has written past since
//! (another host borrowing, Calico's IPAM garbage collection, a call that went on without
//! the lock) costs a conflict, a read and a retry, and nothing else. A copy is what was sent
//! with the revision the datastore answered for it, so it is exactly the stored block. A
//! missing, garbled or half-written file is no copy. One file per block, so that a call
//! reads (and holds in memory) only the blocks it was hinted.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::debug;

use crate::support::net::IpNet;

/// A file larger than this is not read (a /26 block with every address taken is ~20 KB).
const MAX_FILE: u64 = 256 * 1024;

/// One block as written. The block is kept as its JSON text, decoded straight into the
/// allocator's type where it is used.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockCopy {
    pub cidr: IpNet,
    pub revision: String,
    pub block: String,
}

/// Where the copies of the lock file's holders are.
#[derive(Clone, Debug)]
pub struct BlockCopies {
    lock_file: PathBuf,
}

impl BlockCopies {
    /// The copies kept beside the lock file at `lock_file`.
    pub fn beside(lock_file: &Path) -> BlockCopies {
        BlockCopies {
            lock_file: lock_file.to_path_buf(),
        }
    }

    fn path(&self, cidr: IpNet) -> PathBuf {
        let mut p = self.lock_file.as_os_str().to_owned();
        p.push(format!(".block.{}", cidr.to_string().replace('/', "_")));
        PathBuf::from(p)
    }

    /// The copy of `cidr`, if one is kept.
    pub fn get(&self, cidr: IpNet) -> Option<BlockCopy> {
        let path = self.path(cidr);
        let size = std::fs::metadata(&path).ok()?.len();
        if size > MAX_FILE {
            return None;
        }
        let bytes = crate::support::input_file::read(&path).ok()?;
        serde_json::from_slice::<BlockCopy>(&bytes)
            .ok()
            .filter(|c| c.cidr == cidr)
    }

    /// `block` was written at `revision`: it replaces the copy of its CIDR.
    pub fn keep(&self, cidr: IpNet, revision: &str, block: &Value) {
        let copy = BlockCopy {
            cidr,
            revision: revision.to_string(),
            block: block.to_string(),
        };
        if let Err(e) = self.save(&copy) {
            debug!(%cidr, error = %e, "could not keep the block's copy");
            // A file left behind could hold an older copy.
            self.forget(cidr);
        }
    }

    /// What `cidr` holds is not known (a write that failed or whose outcome is unknown, a
    /// delete): its copy goes.
    pub fn forget(&self, cidr: IpNet) {
        let _ = std::fs::remove_file(self.path(cidr));
    }

    /// Written to a new file, then renamed over the old one: never half-written.
    fn save(&self, copy: &BlockCopy) -> std::io::Result<()> {
        let path = self.path(copy.cidr);
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let bytes = serde_json::to_vec(copy)?;
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        std::fs::rename(&tmp, &path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_kept_for_the_next_holder_and_forgotten() {
        let dir = crate::test_support::TempDir::new("block-copies");
        let lock = dir.path().join("ipam.lock");
        let a: IpNet = "10.0.0.0/26".parse().unwrap();
        let b: IpNet = "fd00::/122".parse().unwrap();
        let first = BlockCopies::beside(&lock);
        assert_eq!(first.get(a), None);
        first.keep(
            a,
            "7",
            &serde_json::json!({"cidr": "10.0.0.0/26", "seq": 1}),
        );
        first.keep(b, "8", &serde_json::json!({"cidr": "fd00::/122"}));
        first.keep(
            a,
            "9",
            &serde_json::json!({"cidr": "10.0.0.0/26", "seq": 2}),
        );
        let file = dir.path().join("ipam.lock.block.10.0.0.0_26");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&file).unwrap().permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        let second = BlockCopies::beside(&lock);
        let got = second.get(a).unwrap();
        let block: Value = serde_json::from_str(&got.block).unwrap();
        assert_eq!(
            (got.revision.as_str(), &block["seq"]),
            ("9", &serde_json::json!(2))
        );
        second.forget(a);
        assert_eq!(BlockCopies::beside(&lock).get(a), None);
        assert!(BlockCopies::beside(&lock).get(b).is_some());

        // Garbage, or another block's copy under this name, is no copy.
        std::fs::write(&file, b"{not json").unwrap();
        assert_eq!(BlockCopies::beside(&lock).get(a), None);
        std::fs::copy(dir.path().join("ipam.lock.block.fd00::_122"), &file).unwrap();
        assert_eq!(BlockCopies::beside(&lock).get(a), None);
    }
}
