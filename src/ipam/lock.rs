//! The host-wide IPAM lock: an exclusive `flock` on `ipam_lock_file`, best-effort as
//! upstream (if the directory or the lock cannot be had, log and go on unlocked; every
//! datastore write is a compare-and-swap anyway, the lock only spares contention).
//!
//! Unlike upstream, no local user can stall pod networking with it: the file is created
//! 0600 (as upstream's flock library does) in a directory created 0755 (upstream: 0777),
//! whatever the umask, and the wait is bounded: after `LOCK_WAIT` the call goes on unlocked.
//! The wait is also cut at the call's deadline (`crate::support::deadline`): a call queued behind a
//! stuck holder then goes on unlocked too, and its next datastore request reports the
//! deadline. `LOCK_WAIT` stays shorter than the default deadline on purpose: one stuck holder
//! must not eat the whole budget of every call queued behind it.
//!
//! The file's content is a hint, not state: the holder that assigned addresses leaves there
//! the blocks it assigned from (one CIDR per line), and the next holder reads those blocks
//! together with AutoAssign's other first reads instead of one round trip later. The
//! allocator still walks its blocks exactly as without it (a hinted block is only used where
//! the walk reads that block anyway, and every write is a compare-and-swap); a missing,
//! stale or garbled hint costs nothing but a wasted read. Upstream ignores the content.
//!
//! The file also holds what a crash must not lose: the block writes whose handle may not
//! exist (`pending <handle> <block>` lines, see `IpamLock::intend`). Where the handle and the
//! block are written together (the Kubernetes datastore: two objects, no transaction), the
//! block may land without the handle; until the handle counts the address, this line leads a
//! DEL (or the next holder) to it. A SIGKILL keeps it (it is in the page cache before the
//! writes are sent); a lost file (a reboot without sync) leaves the address to GC and to
//! Calico's own IPAM garbage collection, which find it by its block's attributes.
//!
//! Beside it, on the Kubernetes datastore, the holders keep the blocks they wrote, as written
//! (`block_copies`): the next holder takes the hinted blocks from there instead of reading
//! them while others wait, and where a call read a block before it took the lock (a DEL's
//! first round trip), the copy replaces that read when it is the newer. An ADD there makes
//! all its other reads before taking the lock, which it then holds for its writes only
//! (`Ipam::complete_view`). Like the journal, these are small local files written in place
//! (tmpfs on a node), not I/O worth a thread.

use std::fs::{DirBuilder, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use std::os::unix::fs::FileExt;

use nix::fcntl::{Flock, FlockArg};
use tracing::{debug, info, warn};

use crate::ipam::block_copies::{BlockCopies, BlockCopy};
use crate::support::input_file;
use crate::support::net::IpNet;

/// At most this many hinted blocks are read early (one per family, and a spare).
const MAX_HINTED_BLOCKS: usize = 4;
/// At most this many pending block writes are kept (the oldest go first: a DEL that never
/// came; GC and Calico's IPAM garbage collection still find its address).
const MAX_PENDING: usize = 32;
/// How much of the file is read (the hint and the pending writes; handle IDs are < 300 bytes).
const MAX_FILE: usize = 16 * 1024;
const PENDING: &str = "pending";

/// A block write for `handle` whose handle write may not have landed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub handle: String,
    pub block: IpNet,
}

/// The lock file's content: the hint, then the pending block writes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Content {
    hint: Vec<IpNet>,
    pending: Vec<Pending>,
}

impl Content {
    /// Garbage lines are skipped.
    fn parse(text: &str) -> Content {
        let mut c = Content::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some(PENDING), Some(handle), Some(block)) => {
                    if let Ok(block) = block.parse::<IpNet>() {
                        c.pending.push(Pending {
                            handle: handle.to_string(),
                            block: block.masked(),
                        });
                    }
                }
                (Some(cidr), None, None) if c.hint.len() < MAX_HINTED_BLOCKS => {
                    if let Ok(b) = cidr.parse::<IpNet>() {
                        c.hint.push(b.masked());
                    }
                }
                _ => {}
            }
        }
        c
    }

    fn render(&self) -> String {
        let hint = self.hint.iter().map(|b| format!("{b}\n"));
        let pending = self
            .pending
            .iter()
            .map(|p| format!("{PENDING} {} {}\n", p.handle, p.block));
        hint.chain(pending).collect()
    }
}

/// How long a call waits for the lock before going on without it.
pub const LOCK_WAIT: Duration = Duration::from_secs(10);
const LOCK_FILE_MODE: u32 = 0o600;
const LOCK_DIR_MODE: u32 = 0o755;

/// Held while alive; dropping it unlocks.
pub struct IpamLock {
    _lock: Option<Flock<File>>,
    /// When it was taken (how long it was held is logged at debug level).
    since: Instant,
    /// The blocks the previous holder assigned from (the file's content when taken).
    hint: Vec<IpNet>,
    /// The file's content, to change (None when not locked).
    journal: Option<Journal>,
}

/// The lock file's content as its holder keeps and changes it (the hint, the pending
/// writes): for the allocator to record pending writes in (`Ipam::keep_journal`). Used only
/// while the lock is held (the allocator and the lock live and end with one call).
#[derive(Clone)]
pub struct Journal {
    file: Arc<File>,
    content: Arc<std::sync::Mutex<Content>>,
    /// The blocks as the holders wrote them, beside the file.
    copies: BlockCopies,
}

impl Drop for IpamLock {
    fn drop(&mut self) {
        if self._lock.is_some() {
            debug!(held = ?self.since.elapsed(), "Released host-wide IPAM lock.");
        }
    }
}

impl IpamLock {
    fn held(lock: Option<Flock<File>>, path: &str) -> IpamLock {
        let content = lock.as_deref().map(read_content).unwrap_or_default();
        // A second handle on the same open file (the lock is the open file's): the journal
        // can then be shared with the allocator without the lock.
        let file = lock.as_deref().and_then(|f| match f.try_clone() {
            Ok(f) => Some(Arc::new(f)),
            Err(e) => {
                debug!(error = %e, "no journal in the IPAM lock file");
                None
            }
        });
        IpamLock {
            _lock: lock,
            since: Instant::now(),
            hint: content.hint.clone(),
            journal: file.map(|file| Journal {
                file,
                content: Arc::new(std::sync::Mutex::new(content)),
                copies: BlockCopies::beside(Path::new(path)),
            }),
        }
    }

    /// The file's content to change (None when not locked).
    pub fn journal(&self) -> Option<Journal> {
        self.journal.clone()
    }

    /// Leaves `blocks` (those this call assigned from) for the next holder; nothing when
    /// not locked or when the file already says so. Best effort: a failure is logged.
    pub fn remember_blocks(&self, blocks: &[IpNet]) {
        if let Some(j) = &self.journal {
            j.remember_blocks(blocks);
        }
    }

    /// `Journal::settle`, when locked.
    pub fn settle(&self, handle: &str) {
        if let Some(j) = &self.journal {
            j.settle(handle);
        }
    }

    /// `Journal::pending_for` (nothing when not locked).
    pub fn pending_for(&self, handle: &str) -> Vec<IpNet> {
        self.journal
            .as_ref()
            .map(|j| j.pending_for(handle))
            .unwrap_or_default()
    }
}

impl Journal {
    /// Changes the content and writes it; false when the write failed.
    fn rewrite(&self, change: impl FnOnce(&mut Content) -> bool) -> bool {
        let file = &self.file;
        let Ok(mut content) = self.content.lock() else {
            return false;
        };
        if !change(&mut content) {
            return true;
        }
        let text = content.render();
        let written = file
            .set_len(0)
            .and_then(|()| file.write_all_at(text.as_bytes(), 0));
        match written {
            Ok(()) => true,
            Err(e) => {
                debug!(error = %e, "could not write the IPAM lock file");
                false
            }
        }
    }

    /// Records, before the writes are sent, that `block` may come to hold an address for
    /// `handle` before (or without) the handle counting it. True once recorded: the file is
    /// written (a SIGKILL keeps it); false when the write failed, and the caller must then
    /// write the handle first.
    pub fn intend(&self, handle: &str, block: IpNet) -> bool {
        self.intend_all(handle, &[block])
    }

    /// `intend` for several blocks, in one write of the file; a block already pending for
    /// `handle` is recorded once.
    pub fn intend_all(&self, handle: &str, blocks: &[IpNet]) -> bool {
        // A record is one line of words: a handle it could not be read back as is refused.
        if handle.is_empty() || handle.contains(char::is_whitespace) {
            return false;
        }
        self.rewrite(|c| {
            let mut changed = false;
            for &block in blocks {
                if !c
                    .pending
                    .iter()
                    .any(|p| p.handle == handle && p.block == block)
                {
                    c.pending.push(Pending {
                        handle: handle.to_string(),
                        block,
                    });
                    changed = true;
                }
            }
            let extra = c.pending.len().saturating_sub(MAX_PENDING);
            c.pending.drain(..extra);
            changed
        })
    }

    /// `handle` counts (or no block holds) its addresses: its pending writes are done with.
    pub fn settle(&self, handle: &str) {
        self.rewrite(|c| {
            let before = c.pending.len();
            c.pending.retain(|p| p.handle != handle);
            c.pending.len() != before
        });
    }

    /// The blocks with a pending write for `handle`.
    pub fn pending_for(&self, handle: &str) -> Vec<IpNet> {
        self.content
            .lock()
            .map(|c| pending_blocks(&c, handle))
            .unwrap_or_default()
    }

    /// The blocks as this host's holders last wrote them (`BlockCopies`).
    pub fn copies(&self) -> &BlockCopies {
        &self.copies
    }

    /// `IpamLock::remember_blocks`.
    pub fn remember_blocks(&self, blocks: &[IpNet]) {
        if blocks.is_empty() {
            return;
        }
        self.rewrite(|c| {
            let changed = c.hint != blocks;
            c.hint = blocks.to_vec();
            changed
        });
    }
}

impl IpamLock {
    /// The blocks the previous holder assigned from (empty when not locked).
    pub fn block_hint(&self) -> &[IpNet] {
        &self.hint
    }

    /// The hinted blocks as this host's holders last wrote them (none when not locked).
    pub fn hinted_copies(&self) -> Vec<BlockCopy> {
        let Some(j) = &self.journal else {
            return Vec::new();
        };
        self.hint.iter().filter_map(|c| j.copies.get(*c)).collect()
    }

    /// Takes the lock, waiting at most `min(LOCK_WAIT, what is left of the call's budget)`.
    pub async fn acquire(path: &str) -> IpamLock {
        let (wait, capped) = crate::support::deadline::cap(LOCK_WAIT);
        if capped {
            debug!(?wait, "the IPAM lock wait is cut at the call's deadline");
        }
        Self::acquire_within(path, wait).await
    }

    /// `acquire` with an explicit bound on the wait. Uncontended, it takes the lock at once
    /// (the directory, the file and a non-blocking `flock`: no thread, no wait); contended,
    /// the blocking `flock` runs on a helper thread and the call's runtime awaits it.
    pub async fn acquire_within(path: &str, wait: Duration) -> IpamLock {
        let unlocked = IpamLock::held(None, path);
        if let Err(e) = create_dirs(Path::new(path).parent()) {
            warn!(path, error = %e, "Failed to make directory for IPAM lock; continuing unlocked");
            return unlocked;
        }
        let file = match open_lock_file(path) {
            Ok(f) => f,
            Err(e) => {
                warn!(path, error = %e, "cannot open the IPAM lock file; continuing unlocked");
                return unlocked;
            }
        };
        // Fast path: uncontended.
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(l) => {
                debug!(path, "Acquired host-wide IPAM lock.");
                return IpamLock::held(Some(l), path);
            }
            Err((f, nix::errno::Errno::EWOULDBLOCK)) => f,
            Err((_, e)) => {
                warn!(path, error = %e, "Failed to grab IPAM lock, may contend for datastore updates");
                return unlocked;
            }
        };
        info!(path, "About to acquire host-wide IPAM lock.");
        match wait_for_lock(file, wait).await {
            Some(l) => {
                info!(path, "Acquired host-wide IPAM lock.");
                IpamLock::held(Some(l), path)
            }
            None => {
                warn!(
                    path,
                    waited = ?wait,
                    "IPAM lock still held by another process; continuing without it (datastore writes are compare-and-swap)"
                );
                unlocked
            }
        }
    }
}

/// Creates the missing directories with mode 0755 regardless of the umask.
pub(crate) fn create_dirs(dir: Option<&Path>) -> std::io::Result<()> {
    let Some(dir) = dir.filter(|d| !d.as_os_str().is_empty()) else {
        return Ok(());
    };
    if dir.exists() {
        return Ok(());
    }
    create_dirs(dir.parent())?;
    match DirBuilder::new().mode(LOCK_DIR_MODE).create(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(LOCK_DIR_MODE)),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The hint in the lock file: the CIDRs of its first lines, garbage skipped.
/// The blocks the lock file at `path` names (its hint, and those with a pending write for
/// one of `handles`), read without taking the lock: for reads made before it is taken (a
/// stale or missing line costs a wasted read, nothing else).
pub fn peek_blocks(path: &str, handles: &[String]) -> Vec<IpNet> {
    let c = input_file::open(Path::new(path), OpenOptions::new().read(true))
        .map(|f| read_content(&f))
        .unwrap_or_default();
    let mut blocks = c.hint.clone();
    for h in handles {
        blocks.extend(pending_blocks(&c, h));
    }
    blocks.sort();
    blocks.dedup();
    blocks
}

/// Whether the lock file at `path` has a pending write for one of `handles` (read without
/// the lock: a DEL takes it only when there is something to release).
pub fn peek_pending(path: &str, handles: &[String]) -> bool {
    let c = input_file::open(Path::new(path), OpenOptions::new().read(true))
        .map(|f| read_content(&f))
        .unwrap_or_default();
    handles.iter().any(|h| !pending_blocks(&c, h).is_empty())
}

fn pending_blocks(c: &Content, handle: &str) -> Vec<IpNet> {
    c.pending
        .iter()
        .filter(|p| p.handle == handle)
        .map(|p| p.block)
        .collect()
}

fn read_content(file: &File) -> Content {
    let mut buf = vec![0u8; MAX_FILE];
    let n = file.read_at(&mut buf, 0).unwrap_or(0);
    Content::parse(&String::from_utf8_lossy(&buf[..n]))
}

/// Opens (creating it 0600 regardless of the umask) the lock file, readable for the hint.
/// What is not a regular file is not opened (a FIFO would block the call; see `input_file`):
/// the call then goes on unlocked, as for any lock file it cannot have.
pub(crate) fn open_lock_file(path: impl AsRef<Path>) -> std::io::Result<File> {
    let path = path.as_ref();
    let existed = path.exists();
    let file = input_file::open(
        path,
        OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(LOCK_FILE_MODE),
    )?;
    if !existed {
        file.set_permissions(std::fs::Permissions::from_mode(LOCK_FILE_MODE))?;
    }
    Ok(file)
}

/// A blocking `flock` on a helper thread (the kernel queues the waiters: no polling, and the
/// lock goes to a waiter the moment it is let go), awaited for at most `wait`. If the helper
/// gets the lock after we gave up, it lets it go at once. The thread is the one this wait
/// costs, and only when the lock is contended.
async fn wait_for_lock(file: File, wait: Duration) -> Option<Flock<File>> {
    let (tx, mut rx) = futures::channel::oneshot::channel();
    let abandoned = Arc::new(AtomicBool::new(false));
    let flag = abandoned.clone();
    let spawned = std::thread::Builder::new()
        .name("calico-ipam-lock".into())
        .spawn(move || {
            if let Ok(lock) = Flock::lock(file, FlockArg::LockExclusive) {
                if !flag.load(Ordering::SeqCst) {
                    // The receiver may be gone too; the lock then drops here.
                    let _ = tx.send(lock);
                }
            }
        });
    if spawned.is_err() {
        return None;
    }
    match tokio::time::timeout(wait, &mut rx).await {
        Ok(lock) => lock.ok(),
        Err(_) => {
            abandoned.store(true, Ordering::SeqCst);
            // It may have arrived just now.
            rx.try_recv().ok().flatten()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acquire(path: &str) -> IpamLock {
        within(path, LOCK_WAIT)
    }

    /// `acquire_within` on a runtime of its own, as a call's.
    fn within(path: &str, wait: Duration) -> IpamLock {
        crate::call::client::block_on(IpamLock::acquire_within(path, wait)).unwrap()
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("ipamlock-{name}-{}", std::process::id()))
    }

    #[test]
    fn modes_ignore_the_umask() {
        let dir = scratch("modes");
        let path = dir.join("sub").join("ipam.lock");
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let lock = acquire(path.to_str().unwrap());
        nix::sys::stat::umask(old);
        assert!(lock._lock.is_some());
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(&dir.join("sub")), 0o755);
        assert_eq!(mode(&dir), 0o755);
        drop(lock);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_block_hint_is_left_for_the_next_holder() {
        let dir = scratch("hint");
        let path = dir.join("ipam.lock");
        let p = path.to_str().unwrap();
        let first = acquire(p);
        assert!(first.block_hint().is_empty());
        let blocks: Vec<IpNet> = vec![
            "10.0.0.64/26".parse().unwrap(),
            "fd00::/122".parse().unwrap(),
        ];
        first.remember_blocks(&blocks);
        drop(first);
        let second = acquire(p);
        assert_eq!(second.block_hint(), blocks.as_slice());
        // A shorter hint replaces the longer one entirely.
        second.remember_blocks(&blocks[..1]);
        drop(second);
        assert_eq!(acquire(p).block_hint(), &blocks[..1]);
        // Garbage is skipped; an unlocked caller has no hint and leaves none.
        std::fs::write(&path, "junk\n10.1.2.3/24\n").unwrap();
        assert_eq!(
            acquire(p).block_hint(),
            ["10.1.2.0/24".parse::<IpNet>().unwrap()]
        );
        let holder = acquire(p);
        let unlocked = within(p, Duration::from_millis(10));
        assert!(unlocked.block_hint().is_empty());
        unlocked.remember_blocks(&blocks);
        drop(holder);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "junk\n10.1.2.3/24\n"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Pending writes outlive their holder (a SIGKILL), keep the hint, are found without the
    /// lock, and go when settled; an unlocked caller has no journal.
    #[test]
    fn pending_writes_are_kept_until_settled() {
        let dir = scratch("pending");
        let path = dir.join("ipam.lock");
        let p = path.to_str().unwrap();
        let block: IpNet = "10.0.0.64/26".parse().unwrap();
        let handles = ["net.c1".to_string(), "ns.p1".to_string()];
        let first = acquire(p);
        first.remember_blocks(&[block]);
        let journal = first.journal().unwrap();
        assert!(journal.intend("net.c1", block));
        drop(journal);
        drop(first);
        assert!(peek_pending(p, &handles));
        assert!(!peek_pending(p, &["net.c2".to_string()]));
        assert_eq!(peek_blocks(p, &handles), [block]);
        let second = acquire(p);
        assert_eq!(second.block_hint(), [block]);
        assert_eq!(second.pending_for("net.c1"), [block]);
        // Another call's hint leaves the pending write alone.
        let other: IpNet = "10.0.1.0/26".parse().unwrap();
        second.remember_blocks(&[other]);
        drop(second);
        let third = acquire(p);
        assert_eq!(third.block_hint(), [other]);
        assert_eq!(third.pending_for("net.c1"), [block]);
        let holder_busy = within(p, Duration::from_millis(10));
        assert!(holder_busy.journal().is_none());
        drop(holder_busy);
        third.settle("net.c1");
        drop(third);
        assert!(!peek_pending(p, &handles));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "10.0.1.0/26\n");
        // At most MAX_PENDING are kept, the oldest dropped.
        let fourth = acquire(p);
        let j = fourth.journal().unwrap();
        for i in 0..MAX_PENDING + 2 {
            assert!(j.intend(&format!("h{i}"), block));
        }
        assert!(fourth.pending_for("h0").is_empty());
        assert_eq!(
            fourth.pending_for(&format!("h{}", MAX_PENDING + 1)),
            [block]
        );
        drop(fourth);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_held_lock_is_waited_for_only_so_long() {
        let dir = scratch("held");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ipam.lock");
        let p = path.to_str().unwrap();
        let holder = acquire(p);
        assert!(holder._lock.is_some());
        let start = Instant::now();
        let second = within(p, Duration::from_millis(300));
        assert!(second._lock.is_none());
        assert!(start.elapsed() < Duration::from_secs(2));
        // Released: the next caller gets it while waiting.
        let t = std::thread::spawn({
            let p = p.to_string();
            move || within(&p, Duration::from_secs(5))._lock.is_some()
        });
        std::thread::sleep(Duration::from_millis(100));
        drop(holder);
        assert!(t.join().unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
