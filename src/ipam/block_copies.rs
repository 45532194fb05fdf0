//! The blocks this host's IPAM lock holders last wrote, as written (value and revision), in
//! a file beside the lock file (`<lock file>.blocks`, 0600), written and read only by the
//! lock's holder.
//!
//! The next holder takes such a copy for the block instead of reading it: on a node, the
//! block an ADD assigns from is nearly always the one the previous ADD or DEL on that node
//! wrote, and its read is a quorum read of etcd made while every other call on the node
//! waits for the lock. A copy is no more trusted than a read: the write that follows it is
//! a compare-and-swap on its revision, so a copy someone else has written past since
//! (another host borrowing, Calico's IPAM garbage collection, a call that went on without
//! the lock) costs a conflict, a read and a retry, and nothing else. A copy is what was sent
//! with the revision the datastore answered for it, so it is exactly the stored block. A
//! missing, garbled or half-written file is no copies.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::debug;

use crate::net::IpNet;

/// At most this many blocks are kept (one per family and a spare, as the lock's hint).
const MAX_COPIES: usize = 4;
/// A file larger than this is not read (a /26 block with every address taken is ~20 KB).
const MAX_FILE: u64 = 1024 * 1024;

/// One block as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlockCopy {
    pub cidr: IpNet,
    pub revision: String,
    pub block: Value,
}

/// The copies, as the lock's holder keeps and changes them.
#[derive(Clone, Debug)]
pub struct BlockCopies {
    path: PathBuf,
    copies: Arc<Mutex<Vec<BlockCopy>>>,
}

impl BlockCopies {
    /// The copies kept beside the lock file at `lock_file` (none when there are none).
    pub fn load(lock_file: &Path) -> BlockCopies {
        let mut path = lock_file.as_os_str().to_owned();
        path.push(".blocks");
        let path = PathBuf::from(path);
        let copies = std::fs::metadata(&path)
            .ok()
            .filter(|m| m.len() <= MAX_FILE)
            .and_then(|_| std::fs::read(&path).ok())
            .and_then(|bytes| serde_json::from_slice::<Vec<BlockCopy>>(&bytes).ok())
            .unwrap_or_default();
        BlockCopies {
            path,
            copies: Arc::new(Mutex::new(copies)),
        }
    }

    /// The copy of `cidr`, if one is kept.
    pub fn get(&self, cidr: IpNet) -> Option<BlockCopy> {
        let copies = self.copies.lock().ok()?;
        copies.iter().find(|c| c.cidr == cidr).cloned()
    }

    /// `block` was written at `revision`: it replaces the copy of its CIDR.
    pub fn keep(&self, cidr: IpNet, revision: &str, block: &Value) {
        self.change(|copies| {
            copies.retain(|c| c.cidr != cidr);
            copies.push(BlockCopy {
                cidr,
                revision: revision.to_string(),
                block: block.clone(),
            });
            let extra = copies.len().saturating_sub(MAX_COPIES);
            copies.drain(..extra);
            true
        });
    }

    /// What `cidr` holds is not known (a write that failed or whose outcome is unknown, a
    /// delete): its copy goes.
    pub fn forget(&self, cidr: IpNet) {
        self.change(|copies| {
            let before = copies.len();
            copies.retain(|c| c.cidr != cidr);
            copies.len() != before
        });
    }

    fn change(&self, change: impl FnOnce(&mut Vec<BlockCopy>) -> bool) {
        let Ok(mut copies) = self.copies.lock() else {
            return;
        };
        if change(&mut copies) {
            if let Err(e) = self.save(&copies) {
                debug!(path = %self.path.display(), error = %e, "could not keep the block copies");
                // A file left behind could hold a copy just forgotten.
                let _ = std::fs::remove_file(&self.path);
            }
        }
    }

    /// Written to a new file, then renamed over the old one: never half-written.
    fn save(&self, copies: &[BlockCopy]) -> std::io::Result<()> {
        let mut tmp = self.path.as_os_str().to_owned();
        tmp.push(".new");
        let tmp = PathBuf::from(tmp);
        let bytes = serde_json::to_vec(copies)?;
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&bytes)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_are_kept_for_the_next_holder_and_forgotten() {
        let dir = std::env::temp_dir().join(format!("block-copies-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lock = dir.join("ipam.lock");
        let a: IpNet = "10.0.0.0/26".parse().unwrap();
        let b: IpNet = "fd00::/122".parse().unwrap();
        let first = BlockCopies::load(&lock);
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
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(dir.join("ipam.lock.blocks"))
                .unwrap()
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o600);

        let second = BlockCopies::load(&lock);
        let got = second.get(a).unwrap();
        assert_eq!(
            (got.revision.as_str(), &got.block["seq"]),
            ("9", &serde_json::json!(2))
        );
        second.forget(a);
        assert_eq!(BlockCopies::load(&lock).get(a), None);
        assert!(BlockCopies::load(&lock).get(b).is_some());

        // Garbage is no copies.
        std::fs::write(dir.join("ipam.lock.blocks"), b"{not json").unwrap();
        assert_eq!(BlockCopies::load(&lock).get(b), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn at_most_four_are_kept() {
        let dir = std::env::temp_dir().join(format!("block-copies-max-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lock = dir.join("ipam.lock");
        let copies = BlockCopies::load(&lock);
        let cidrs: Vec<IpNet> = (0..6)
            .map(|i| format!("10.0.{i}.0/26").parse().unwrap())
            .collect();
        for c in &cidrs {
            copies.keep(*c, "1", &Value::Null);
        }
        let again = BlockCopies::load(&lock);
        assert!(cidrs[..2].iter().all(|c| again.get(*c).is_none()));
        assert!(cidrs[2..].iter().all(|c| again.get(*c).is_some()));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
