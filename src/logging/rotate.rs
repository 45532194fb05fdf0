//! The log file and its rotation, made to leave on disk what upstream (v3.32.1) leaves: its
//! `ConfigureLogging` writes `log_file_path` through timberjack v1.3.9 with zstd compression,
//! UTC names and size-based rotation only. What that logger does, and so what this does:
//!
//! * **When**: the file is opened on the first write, not before (a process that logs
//!   nothing at `log_level` touches nothing). If the file then holds `size` bytes and
//!   `size + line >= max`, it is rotated first; after that, a write that would take it past
//!   `max` (`size + line > max`) rotates it first. A line longer than `max` is never
//!   written. `max` is `log_file_max_size` MiB (100 when 0); a negative size refuses every
//!   write, so nothing is logged to the file at all.
//! * **Names**: `cni.log` becomes `cni-<UTC time>-size.log` (Go's filepath.Ext splits off
//!   the extension; the time is `2006-01-02T15-04-05.000`, milliseconds truncated). A file
//!   that exists but cannot be opened for appending is moved aside as `…-initial.log`.
//!   A backup is compressed to `<backup>.zst` (the `.log` stays inside the name) and the
//!   uncompressed one removed once the compressed one is whole.
//! * **Pruning** (the "mill"), after the first open and after each rotation: the backups
//!   are the files named `<stem>-<time>-<reason><ext>`, with `.gz` or `.zst` after that or
//!   not, whose time parses; newest first by that time. `log_file_max_count` (10 when 0; no
//!   limit when negative) keeps the newest that many distinct times, `log_file_max_age` (30
//!   days when 0; none when negative) then removes those whose time is older than that many
//!   24-hour days; what is left and not compressed yet is compressed. So after a rollback
//!   upstream recognises, prunes and compresses our backups, and we its.
//!
//! Where this differs, and why. Upstream mills and compresses on a goroutine that a CNI
//! process, living a fraction of a second, usually does not let finish; here the mill runs
//! inline and compresses at most one backup per mill, the newest (normally the one just
//! rotated): one rotation per `max` bytes of log pays for compressing it (zstd level 1,
//! streamed: 0.48 s for 100 MiB of log, release build on a busy 2-core machine), no other
//! call pays anything but a directory listing.
//! Many CNI processes share the file: a rotation is made by the one process holding the
//! file's `flock`, which looks again first (another may have just rotated it), and the new
//! file is opened for appending, never truncated; a backup is compressed under its own
//! `flock`, so two processes never write one `.zst`. Files are created with their mode set
//! whatever the umask (0644, a rotated file's successor and a backup's `.zst` keep the
//! mode of the file they replace, and its owner as timberjack does).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use nix::fcntl::{Flock, FlockArg};

use crate::support::timefmt;

/// timberjack's unit of `MaxSize`.
pub const MEGABYTE: i64 = 1024 * 1024;
/// The suffix of a zstd-compressed backup.
pub const ZSTD_SUFFIX: &str = ".zst";
/// The suffix of a gzip-compressed backup (timberjack's other compression; recognised).
pub const GZIP_SUFFIX: &str = ".gz";
/// zstd's fastest standard level: the frame is the same format any level writes.
const ZSTD_LEVEL: i32 = 1;
/// Mode of a newly created log file, whatever the umask (upstream's `FileMode`).
pub const LOG_FILE_MODE: u32 = 0o644;
/// Nanoseconds in one of `log_file_max_age`'s days (24 hours, as timberjack counts them).
const DAY_NANOS: i128 = 24 * 3600 * 1_000_000_000;

/// The rotation settings, from the NetConf as upstream's `ConfigureLogging` sets them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The size the file may reach, in bytes; zero or less refuses every write.
    pub max_bytes: i64,
    /// Backups older than this many days are removed (none when zero or less).
    pub max_age_days: i64,
    /// Backups of more than this many rotations are removed (none when zero or less).
    pub max_backups: i64,
}

impl Limits {
    /// `log_file_max_size` (MiB), `log_file_max_age` (days), `log_file_max_count`: each 0
    /// means upstream's default (100, 30, 10), anything else is taken as it is.
    pub fn from_conf(max_size: i64, max_age: i64, max_count: i64) -> Limits {
        let or = |v: i64, default: i64| if v != 0 { v } else { default };
        Limits {
            max_bytes: or(max_size, 100).saturating_mul(MEGABYTE),
            max_age_days: or(max_age, 30),
            max_backups: or(max_count, 10),
        }
    }
}

/// Why a line did not reach the file.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("write length {len} exceeds maximum file size {max}")]
    TooLong { len: i64, max: i64 },
    #[error("can't open log file {path}: {source}")]
    Open { path: String, source: io::Error },
    #[error("can't rotate log file {path}: {source}")]
    Rotate { path: String, source: io::Error },
    #[error("write to log file {path}: {source}")]
    Write { path: String, source: io::Error },
}

/// A file name split as Go's `filepath.Ext` splits it: the stem, and the extension from the
/// last dot on (`""` when there is none).
fn stem_and_ext(name: &str) -> (&str, &str) {
    match name.rfind('.') {
        Some(i) => (&name[..i], &name[i..]),
        None => (name, ""),
    }
}

/// The directory, stem and extension of the log file's path.
fn parts(path: &Path) -> (PathBuf, String, String) {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let (stem, ext) = stem_and_ext(&name);
    (dir, stem.to_string(), ext.to_string())
}

/// `t` as timberjack's `2006-01-02T15-04-05.000` in UTC, milliseconds truncated.
pub fn format_time(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let (y, mo, day, h, mi, s) = timefmt::civil(secs);
    let ms = d.subsec_millis();
    format!("{y:04}-{mo:02}-{day:02}T{h:02}-{mi:02}-{s:02}.{ms:03}")
}

/// The name the log file at `path` is given when rotated at `t` for `reason`.
pub fn backup_name(path: &Path, reason: &str, t: SystemTime) -> PathBuf {
    let (dir, stem, ext) = parts(path);
    dir.join(format!("{stem}-{}-{reason}{ext}", format_time(t)))
}

/// Parses a time in timberjack's layout as Go's `time.Parse` reads it (UTC): four-digit
/// year, two-digit month, day, minute and second, a one- or two-digit hour, and `.` or `,`
/// then exactly three digits; each field in range. Nanoseconds since the Unix epoch.
pub fn parse_time(ts: &str) -> Option<i128> {
    let b = ts.as_bytes();
    let mut at = 0;
    let digits = |n: usize, at: &mut usize| -> Option<i64> {
        let s = b.get(*at..*at + n)?;
        if !s.iter().all(u8::is_ascii_digit) {
            return None;
        }
        *at += n;
        s.iter()
            .try_fold(0i64, |v, d| Some(v * 10 + i64::from(d - b'0')))
    };
    let lit = |c: &[u8], at: &mut usize| -> Option<()> {
        let got = b.get(*at)?;
        c.contains(got).then(|| *at += 1)
    };
    let year = digits(4, &mut at)?;
    lit(b"-", &mut at)?;
    let month = digits(2, &mut at)?;
    lit(b"-", &mut at)?;
    let day = digits(2, &mut at)?;
    lit(b"T", &mut at)?;
    // Go's "15" takes one or two digits.
    let two = b.get(at + 1).is_some_and(u8::is_ascii_digit);
    let hour = digits(if two { 2 } else { 1 }, &mut at)?;
    lit(b"-", &mut at)?;
    let minute = digits(2, &mut at)?;
    lit(b"-", &mut at)?;
    let second = digits(2, &mut at)?;
    lit(b".,", &mut at)?;
    let millis = digits(3, &mut at)?;
    if at != b.len() {
        return None;
    }
    let month_ok = (1..=12).contains(&month);
    let month_u = u32::try_from(month).ok()?;
    if !month_ok
        || day < 1
        || day > i64::from(timefmt::days_in_month(year, month_u))
        || hour > 23
        || minute > 59
        || second > 59
    {
        return None;
    }
    let secs =
        timefmt::days_from_civil(year, month, day) * 86400 + hour * 3600 + minute * 60 + second;
    Some(i128::from(secs) * 1_000_000_000 + i128::from(millis) * 1_000_000)
}

/// The rotation time in a backup's name, when `name` is `<stem>-<time>-<reason><ext>`.
fn time_from_name(name: &str, prefix: &str, ext: &str) -> Option<i128> {
    let trimmed = name.strip_prefix(prefix)?.strip_suffix(ext)?;
    let hyphen = trimmed.rfind('-')?;
    parse_time(&trimmed[..hyphen])
}

/// A backup of the log file: its name in the log directory and its rotation time.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backup {
    pub name: String,
    /// Nanoseconds since the Unix epoch (UTC), from the name.
    pub time: i128,
}

impl Backup {
    fn compressed(&self) -> bool {
        self.name.ends_with(GZIP_SUFFIX) || self.name.ends_with(ZSTD_SUFFIX)
    }
}

/// The backup a directory entry named `name` is, for the log file named `stem` + `ext`.
pub fn recognise(name: &str, stem: &str, ext: &str) -> Option<Backup> {
    let prefix = format!("{stem}-");
    [
        ext.to_string(),
        format!("{ext}{GZIP_SUFFIX}"),
        format!("{ext}{ZSTD_SUFFIX}"),
    ]
    .iter()
    .find_map(|e| time_from_name(name, &prefix, e))
    .map(|time| Backup {
        name: name.to_string(),
        time,
    })
}

/// What a mill does: the backups to remove, and those to compress (newest first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub remove: Vec<String>,
    pub compress: Vec<String>,
}

/// The mill's decisions for `backups` at `now` (nanoseconds since the epoch): keep the
/// newest `max_backups` distinct rotation times, then drop what is older than `max_age_days`
/// days; compress what is left uncompressed.
pub fn plan(backups: &[Backup], limits: &Limits, now: i128) -> Plan {
    let mut sorted = backups.to_vec();
    sorted.sort_by_key(|b| std::cmp::Reverse(b.time));
    let mut plan = Plan::default();
    let mut kept = Vec::with_capacity(sorted.len());
    let mut distinct = 0i64;
    let mut last = None;
    for b in sorted {
        if last != Some(b.time) {
            distinct += 1;
            last = Some(b.time);
        }
        let too_many = limits.max_backups > 0 && distinct > limits.max_backups;
        let too_old =
            limits.max_age_days > 0 && b.time < now - i128::from(limits.max_age_days) * DAY_NANOS;
        if too_many || too_old {
            plan.remove.push(b.name);
        } else {
            kept.push(b);
        }
    }
    plan.compress = kept
        .into_iter()
        .filter(|b| !b.compressed())
        .map(|b| b.name)
        .collect();
    plan
}

/// The backups of the log file at `path` found in its directory.
pub fn list_backups(path: &Path) -> io::Result<Vec<Backup>> {
    let (dir, stem, ext) = parts(path);
    let mut found = Vec::new();
    for entry in fs::read_dir(&dir)? {
        let Ok(entry) = entry else { continue };
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        if let Some(name) = entry.file_name().to_str() {
            found.extend(recognise(name, &stem, &ext));
        }
    }
    Ok(found)
}

/// Prunes the backups of the log file at `path` and compresses the newest one not yet
/// compressed (only one: see the module's head). Problems are returned as text to report,
/// the mill goes on past them.
pub fn mill(path: &Path, limits: &Limits, now: SystemTime) -> Vec<String> {
    let mut problems = Vec::new();
    let backups = match list_backups(path) {
        Ok(b) => b,
        Err(e) => return vec![format!("can't read log file directory: {e}")],
    };
    let now = now
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as i128)
        .unwrap_or(0);
    let plan = plan(&backups, limits, now);
    let (dir, _, _) = parts(path);
    for name in &plan.remove {
        match fs::remove_file(dir.join(name)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                problems.push(format!("failed to remove old log file {name}: {e}"))
            }
            _ => {}
        }
    }
    if let Some(name) = plan.compress.first() {
        let src = dir.join(name);
        let dst = dir.join(format!("{name}{ZSTD_SUFFIX}"));
        if let Err(e) = compress(&src, &dst) {
            problems.push(format!("failed to compress log file {name}: {e}"));
        }
    }
    problems
}

/// Compresses `src` into `dst` (zstd, with a checksum), then removes `src`. Skipped when
/// another process holds `src`'s lock (it is compressing it) or has removed it. A partial
/// `dst` is removed; `src` goes only once `dst` is whole.
pub fn compress(src: &Path, dst: &Path) -> io::Result<()> {
    let file = match File::open(src) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        other => other?,
    };
    let Ok(locked) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
        return Ok(());
    };
    let meta = locked.metadata()?;
    if meta.nlink() == 0 {
        return Ok(());
    }
    let mode = meta.mode() & 0o7777;
    let out = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(dst)?;
    let written = (|| {
        out.set_permissions(fs::Permissions::from_mode(mode))?;
        let mut enc = zstd::stream::write::Encoder::new(&out, ZSTD_LEVEL)?;
        enc.include_checksum(true)?;
        io::copy(&mut &*locked, &mut enc)?;
        enc.finish()?;
        Ok::<_, io::Error>(())
    })();
    if let Err(e) = written {
        drop(out);
        let _ = fs::remove_file(dst);
        return Err(e);
    }
    let _ = std::os::unix::fs::fchown(&out, Some(meta.uid()), Some(meta.gid()));
    fs::remove_file(src)
}

/// Opens `path` for appending, creating it with `mode` whatever the umask, and the size it
/// has.
fn open_append(path: &Path, mode: u32) -> io::Result<(File, u64)> {
    let created = OpenOptions::new()
        .append(true)
        .create_new(true)
        .mode(mode)
        .open(path);
    match created {
        Ok(file) => {
            // The umask may have narrowed the mode.
            let _ = file.set_permissions(fs::Permissions::from_mode(mode));
            Ok((file, 0))
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let file = crate::support::input_file::open(path, OpenOptions::new().append(true))?;
            let len = file.metadata()?.len();
            Ok((file, len))
        }
        Err(e) => Err(e),
    }
}

/// Creates the missing directories of `dir` with mode 0755 regardless of the umask.
pub fn create_dirs(dir: &Path) -> io::Result<()> {
    if dir.as_os_str().is_empty() || dir.exists() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        create_dirs(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(0o755)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// The log file of one process: opened on the first write, rotated and milled as the
/// module's head says. The clock is a parameter so that names can be tested.
pub struct RotatingFile {
    path: PathBuf,
    limits: Limits,
    clock: fn() -> SystemTime,
    file: Option<File>,
    /// The file's size as this process knows it (its size when opened plus what it wrote).
    size: i64,
    milled: bool,
}

impl RotatingFile {
    pub fn new(path: &Path, limits: Limits) -> RotatingFile {
        Self::with_clock(path, limits, SystemTime::now)
    }

    pub fn with_clock(path: &Path, limits: Limits, clock: fn() -> SystemTime) -> RotatingFile {
        RotatingFile {
            path: path.to_path_buf(),
            limits,
            clock,
            file: None,
            size: 0,
            milled: false,
        }
    }

    fn path_text(&self) -> String {
        self.path.display().to_string()
    }

    /// Writes one line (one event), rotating first when it is due; problems the mill met
    /// are handed to `report`.
    pub fn write_line(
        &mut self,
        buf: &[u8],
        report: &mut dyn FnMut(&str),
    ) -> Result<(), WriteError> {
        let len = i64::try_from(buf.len()).unwrap_or(i64::MAX);
        let max = self.limits.max_bytes;
        if len > max {
            return Err(WriteError::TooLong { len, max });
        }
        if self.file.is_none() {
            self.open_existing_or_new(len, report)?;
        } else if self.size.saturating_add(len) > max {
            self.rotate(|size| size.saturating_add(len) > max, report)?;
        }
        let Some(file) = self.file.as_mut() else {
            return Ok(());
        };
        file.write_all(buf).map_err(|source| WriteError::Write {
            path: self.path.display().to_string(),
            source,
        })?;
        self.size = self.size.saturating_add(len);
        Ok(())
    }

    fn run_mill(&mut self, report: &mut dyn FnMut(&str)) {
        for p in mill(&self.path, &self.limits, (self.clock)()) {
            report(&p);
        }
    }

    fn open_existing_or_new(
        &mut self,
        len: i64,
        report: &mut dyn FnMut(&str),
    ) -> Result<(), WriteError> {
        let open_err = |path: &Path, source| WriteError::Open {
            path: path.display().to_string(),
            source,
        };
        if let Some(dir) = self.path.parent() {
            create_dirs(dir).map_err(|e| open_err(&self.path, e))?;
        }
        if !self.milled {
            self.milled = true;
            self.run_mill(report);
        }
        let max = self.limits.max_bytes;
        let size = match fs::metadata(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(open_err(&self.path, e)),
            // A FIFO (or anything else not a regular file) is not opened: it could block
            // the call (`crate::support::input_file`); nor is it moved aside. The lines are dropped.
            Ok(m) if !m.is_file() => {
                return Err(open_err(
                    &self.path,
                    crate::support::input_file::not_regular(),
                ))
            }
            Ok(m) => Some(i64::try_from(m.len()).unwrap_or(i64::MAX)),
        };
        match size {
            Some(size) if size.saturating_add(len) >= max => {
                self.rotate(|size| size.saturating_add(len) >= max, report)
            }
            Some(_) => {
                match crate::support::input_file::open(&self.path, OpenOptions::new().append(true))
                {
                    Ok(f) => {
                        self.size = f
                            .metadata()
                            .map(|m| i64::try_from(m.len()).unwrap_or(i64::MAX))
                            .unwrap_or_default();
                        self.file = Some(f);
                        Ok(())
                    }
                    // timberjack moves a file it cannot append to aside, as a backup.
                    Err(_) => {
                        let aside = backup_name(&self.path, "initial", (self.clock)());
                        fs::rename(&self.path, &aside).map_err(|source| WriteError::Rotate {
                            path: self.path_text(),
                            source,
                        })?;
                        self.open_new(LOG_FILE_MODE, None)
                    }
                }
            }
            None => self.open_new(LOG_FILE_MODE, None),
        }
    }

    fn open_new(&mut self, mode: u32, owner: Option<(u32, u32)>) -> Result<(), WriteError> {
        let (file, size) = open_append(&self.path, mode).map_err(|source| WriteError::Open {
            path: self.path_text(),
            source,
        })?;
        if let Some((uid, gid)) = owner {
            let _ = std::os::unix::fs::fchown(&file, Some(uid), Some(gid));
        }
        self.size = i64::try_from(size).unwrap_or(i64::MAX);
        self.file = Some(file);
        Ok(())
    }

    /// Rotates the file at the path if `due(its size)` still holds once this process holds
    /// its lock; when another process holds it (rotating it), or rotated it meanwhile, the
    /// file now at the path is written instead.
    fn rotate(
        &mut self,
        due: impl Fn(i64) -> bool,
        report: &mut dyn FnMut(&str),
    ) -> Result<(), WriteError> {
        let rotate_err = |path: &Path, source| WriteError::Rotate {
            path: path.display().to_string(),
            source,
        };
        self.file = None;
        let (current, _) =
            open_append(&self.path, LOG_FILE_MODE).map_err(|e| rotate_err(&self.path, e))?;
        let locked = match Flock::lock(current, FlockArg::LockExclusiveNonblock) {
            Ok(l) => l,
            Err((current, _)) => {
                // Being rotated by another process: its lines and ours move together.
                self.size = current
                    .metadata()
                    .map(|m| i64::try_from(m.len()).unwrap_or(i64::MAX))
                    .unwrap_or_default();
                self.file = Some(current);
                return Ok(());
            }
        };
        let held = locked.metadata().map_err(|e| rotate_err(&self.path, e))?;
        let at_path = fs::metadata(&self.path).ok();
        let same = at_path
            .as_ref()
            .is_some_and(|m| m.dev() == held.dev() && m.ino() == held.ino());
        let size = i64::try_from(held.len()).unwrap_or(i64::MAX);
        if !same || !due(size) {
            drop(locked);
            return self.open_new(LOG_FILE_MODE, None);
        }
        let backup = backup_name(&self.path, "size", (self.clock)());
        fs::rename(&self.path, &backup).map_err(|e| rotate_err(&self.path, e))?;
        let mode = held.mode() & 0o7777;
        let result = self.open_new(mode, Some((held.uid(), held.gid())));
        drop(locked);
        result?;
        self.run_mill(report);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// 2026-03-04T05:06:07.891 UTC.
    fn fixed() -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(1_772_600_767_891)
    }

    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("logrot-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn backup_names_are_timberjacks() {
        assert_eq!(format_time(fixed()), "2026-03-04T05-06-07.891");
        // Milliseconds are truncated, not rounded.
        let t = UNIX_EPOCH + Duration::from_nanos(1_772_600_767_891_999_999);
        assert_eq!(format_time(t), "2026-03-04T05-06-07.891");
        assert_eq!(
            backup_name(Path::new("/var/log/calico/cni/cni.log"), "size", fixed()),
            Path::new("/var/log/calico/cni/cni-2026-03-04T05-06-07.891-size.log")
        );
        assert_eq!(
            backup_name(Path::new("/l/cni"), "size", fixed()),
            Path::new("/l/cni-2026-03-04T05-06-07.891-size")
        );
        assert_eq!(
            backup_name(Path::new("/l/a.b.txt"), "initial", fixed()),
            Path::new("/l/a.b-2026-03-04T05-06-07.891-initial.txt")
        );
        assert_eq!(
            backup_name(Path::new("cni.log"), "size", fixed()),
            Path::new("./cni-2026-03-04T05-06-07.891-size.log")
        );
    }

    #[test]
    fn names_are_recognised_as_timberjack_parses_them() {
        let t = parse_time("2026-03-04T05-06-07.891").unwrap();
        assert_eq!(t, 1_772_600_767_891_000_000);
        let ok = |n: &str| recognise(n, "cni", ".log").map(|b| b.time);
        assert_eq!(ok("cni-2026-03-04T05-06-07.891-size.log"), Some(t));
        assert_eq!(ok("cni-2026-03-04T05-06-07.891-size.log.zst"), Some(t));
        assert_eq!(ok("cni-2026-03-04T05-06-07.891-size.log.gz"), Some(t));
        assert_eq!(ok("cni-2026-03-04T05-06-07.891-time.log"), Some(t));
        assert_eq!(
            ok("cni-2026-03-04T05-06-07.891-.log"),
            Some(t),
            "empty reason"
        );
        assert_eq!(ok("cni-2026-03-04T05-06-07,891-x.log"), Some(t), "comma");
        assert_eq!(
            ok("cni-2026-03-04T5-06-07.891-size.log"),
            Some(t),
            "a one-digit hour, as Go's \"15\""
        );
        for bad in [
            "cni.log",
            "cni.log.1",
            "cni-2026-03-04T05-06-07.891.log",
            "cni-2026-03-04T05-06-07.89-size.log",
            "cni-2026-03-04T05-06-07.8910-size.log",
            "cni-2026-02-30T05-06-07.891-size.log",
            "cni-2026-13-04T05-06-07.891-size.log",
            "cni-2026-03-04T24-06-07.891-size.log",
            "cni-2026-03-04 05-06-07.891-size.log",
            "cni-2026-03-04T05-06-07.891-size.log.xz",
            "other-2026-03-04T05-06-07.891-size.log",
            "cni-2026-03-04T05-06-07.891-size.txt",
        ] {
            assert_eq!(ok(bad), None, "{bad}");
        }
        // 2024 is a leap year, 2100 is not.
        assert!(parse_time("2024-02-29T00-00-00.000").is_some());
        assert!(parse_time("2100-02-29T00-00-00.000").is_none());
    }

    fn backup(name: &str) -> Backup {
        recognise(name, "cni", ".log").unwrap()
    }

    #[test]
    fn pruning_keeps_the_newest_rotations_then_drops_the_old() {
        // A millisecond past 30 days after 03-01: that one is older, 03-02 is not.
        let now = parse_time("2026-03-31T00-00-00.001").unwrap();
        let limits = Limits::from_conf(0, 0, 0);
        assert_eq!(
            limits,
            Limits {
                max_bytes: 100 * MEGABYTE,
                max_age_days: 30,
                max_backups: 10
            }
        );
        let all: Vec<Backup> = (1..=12)
            .map(|d| backup(&format!("cni-2026-03-{d:02}T00-00-00.000-size.log.zst")))
            .collect();
        // Twelve rotations: the two oldest go by count.
        let p = plan(&all, &limits, now);
        assert_eq!(
            p.remove,
            vec![
                "cni-2026-03-02T00-00-00.000-size.log.zst",
                "cni-2026-03-01T00-00-00.000-size.log.zst"
            ]
        );
        assert!(p.compress.is_empty());
        // By age alone (no count limit): only what is older than 30 × 24 h.
        let by_age = Limits {
            max_backups: -1,
            ..limits
        };
        let p = plan(&all, &by_age, now);
        assert_eq!(p.remove, vec!["cni-2026-03-01T00-00-00.000-size.log.zst"]);
        // Exactly 30 days old is not older.
        let p = plan(&all, &by_age, now - 1_000_000);
        assert!(p.remove.is_empty());
        // Nothing pruned when both are negative.
        let keep_all = Limits {
            max_backups: -1,
            max_age_days: -5,
            ..limits
        };
        assert!(plan(&all, &keep_all, now).remove.is_empty());
    }

    #[test]
    fn pruning_counts_rotations_not_files_and_compresses_what_is_left() {
        let now = parse_time("2026-03-10T00-00-00.000").unwrap();
        let limits = Limits {
            max_bytes: MEGABYTE,
            max_age_days: 30,
            max_backups: 2,
        };
        let files = [
            // One rotation left both forms (a compression cut short): they count once.
            "cni-2026-03-09T00-00-00.000-size.log",
            "cni-2026-03-09T00-00-00.000-size.log.zst",
            "cni-2026-03-08T00-00-00.000-size.log",
            "cni-2026-03-07T00-00-00.000-size.log.gz",
            "cni-2026-03-06T00-00-00.000-size.log",
        ];
        let all: Vec<Backup> = files.iter().map(|n| backup(n)).collect();
        let p = plan(&all, &limits, now);
        let mut removed = p.remove.clone();
        removed.sort();
        assert_eq!(
            removed,
            vec![
                "cni-2026-03-06T00-00-00.000-size.log",
                "cni-2026-03-07T00-00-00.000-size.log.gz"
            ]
        );
        assert_eq!(
            p.compress,
            vec![
                "cni-2026-03-09T00-00-00.000-size.log",
                "cni-2026-03-08T00-00-00.000-size.log"
            ]
        );
    }

    #[test]
    fn a_mill_prunes_and_compresses_the_newest_backup() {
        let dir = scratch("mill");
        let path = dir.join("cni.log");
        fs::write(&path, b"current\n").unwrap();
        fs::write(dir.join("cni.log.1"), b"ours, old style\n").unwrap();
        let newest = "cni-2026-03-04T05-06-07.891-size.log";
        let older = "cni-2026-03-03T05-06-07.891-size.log";
        let ancient = "cni-2026-01-01T00-00-00.000-size.log.zst";
        fs::write(dir.join(newest), b"rotated\n".repeat(1000)).unwrap();
        fs::set_permissions(dir.join(newest), fs::Permissions::from_mode(0o600)).unwrap();
        fs::write(dir.join(older), b"older\n").unwrap();
        fs::write(dir.join(ancient), b"x").unwrap();
        let problems = mill(&path, &Limits::from_conf(0, 0, 0), fixed());
        assert!(problems.is_empty(), "{problems:?}");
        // The ancient one is past 30 days; the older one waits for the next mill.
        assert_eq!(
            names(&dir),
            vec![
                "cni-2026-03-03T05-06-07.891-size.log",
                "cni-2026-03-04T05-06-07.891-size.log.zst",
                "cni.log",
                "cni.log.1",
            ]
        );
        let zst = dir.join(format!("{newest}.zst"));
        let back = zstd::stream::decode_all(File::open(&zst).unwrap()).unwrap();
        assert_eq!(back, b"rotated\n".repeat(1000));
        assert_eq!(fs::metadata(&zst).unwrap().mode() & 0o777, 0o600);
        assert!(mill(&path, &Limits::from_conf(0, 0, 0), fixed()).is_empty());
        assert!(names(&dir).contains(&format!("{older}.zst")));
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_rotate_by_size_with_the_line_that_would_overflow() {
        let dir = scratch("write");
        let path = dir.join("sub").join("cni.log");
        let limits = Limits {
            max_bytes: 100,
            max_age_days: 30,
            max_backups: 10,
        };
        let mut f = RotatingFile::with_clock(&path, limits, fixed);
        let mut problems = Vec::new();
        let mut report = |p: &str| problems.push(p.to_string());
        // Nothing exists until the first write.
        assert!(!dir.join("sub").exists());
        f.write_line(&[b'a'; 60], &mut report).unwrap();
        f.write_line(&[b'b'; 40], &mut report).unwrap();
        // 60 + 40 = 100 is not past the limit; one byte more is.
        assert_eq!(names(&dir.join("sub")), vec!["cni.log"]);
        f.write_line(b"c", &mut report).unwrap();
        let backup = "cni-2026-03-04T05-06-07.891-size.log";
        assert_eq!(
            names(&dir.join("sub")),
            vec![format!("{backup}.zst"), "cni.log".to_string()]
        );
        assert_eq!(fs::read(&path).unwrap(), b"c");
        let z = File::open(dir.join("sub").join(format!("{backup}.zst"))).unwrap();
        let mut want = vec![b'a'; 60];
        want.extend_from_slice(&[b'b'; 40]);
        assert_eq!(zstd::stream::decode_all(z).unwrap(), want);
        // A line longer than the limit is refused.
        assert!(matches!(
            f.write_line(&[b'd'; 101], &mut report),
            Err(WriteError::TooLong { len: 101, max: 100 })
        ));
        assert!(problems.is_empty(), "{problems:?}");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_full_file_is_rotated_when_opened() {
        let dir = scratch("open");
        let path = dir.join("cni.log");
        fs::write(&path, [b'x'; 90]).unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        let limits = Limits {
            max_bytes: 100,
            max_age_days: 30,
            max_backups: 10,
        };
        // 90 + 10 reaches the limit: when opening, that is enough (timberjack's `>=`).
        let mut f = RotatingFile::with_clock(&path, limits, fixed);
        f.write_line(&[b'y'; 10], &mut |p| panic!("{p}")).unwrap();
        assert_eq!(fs::read(&path).unwrap(), [b'y'; 10]);
        // The new file keeps the mode of the one it replaces.
        assert_eq!(fs::metadata(&path).unwrap().mode() & 0o777, 0o640);
        let z = dir.join("cni-2026-03-04T05-06-07.891-size.log.zst");
        assert_eq!(
            zstd::stream::decode_all(File::open(z).unwrap()).unwrap(),
            [b'x'; 90]
        );
        // Under the limit, the file is appended to.
        let mut g = RotatingFile::with_clock(&path, limits, fixed);
        g.write_line(&[b'z'; 10], &mut |p| panic!("{p}")).unwrap();
        assert_eq!(fs::metadata(&path).unwrap().len(), 20);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_negative_size_refuses_every_write() {
        let dir = scratch("neg");
        let path = dir.join("cni.log");
        let mut f = RotatingFile::new(&path, Limits::from_conf(-1, 0, 0));
        assert!(f.write_line(b"x\n", &mut |_| {}).is_err());
        assert!(!path.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_new_file_is_0644_whatever_the_umask() {
        let dir = scratch("mode");
        let path = dir.join("a").join("b").join("cni.log");
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
        let mut f = RotatingFile::new(&path, Limits::from_conf(0, 0, 0));
        let r = f.write_line(b"x\n", &mut |_| {});
        nix::sys::stat::umask(old);
        r.unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o644);
        assert_eq!(mode(&dir.join("a")), 0o755);
        assert_eq!(mode(&dir.join("a").join("b")), 0o755);
        fs::remove_dir_all(&dir).unwrap();
    }
}
