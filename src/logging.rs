//! Logging with `tracing`, as upstream's `ConfigureLogging` (v3.32.1): every event at
//! `log_level` goes to stderr and, only when `log_file_path` is set, to that file as well,
//! with size-based rotation. Lines look like Calico's:
//! `2026-01-02 03:04:05.678 [INFO][1234] cni-plugin/add.rs 42: msg k=v`.
//!
//! Logging never blocks, fails or slows a call: stderr is written with one `write(2)` per
//! event on fd 2 (no process-wide stdio lock, so helper threads can log while the main
//! thread waits for them), the file through its own descriptor, and a failed write (a full
//! disk, a closed pipe) is dropped silently. Never log secrets: callers log config
//! summaries, not raw stdin.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::writer::{BoxMakeWriter, MakeWriterExt};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, MakeWriter};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

use crate::config::NetConf;

/// Mode of the directories created for the log file, whatever the umask.
const LOG_DIR_MODE: u32 = 0o755;
/// Mode of a newly created log file, whatever the umask.
const LOG_FILE_MODE: u32 = 0o644;

/// Parses Calico's `log_level` as v3.32.1 does: `debug`, `info` or `error`, any case;
/// anything else means info.
pub fn parse_level(s: &str) -> Level {
    match s.to_ascii_lowercase().as_str() {
        "debug" => Level::DEBUG,
        "error" => Level::ERROR,
        _ => Level::INFO,
    }
}

/// Writes to fd 2 directly: one `write(2)` per event, errors dropped, no `Stderr` lock.
struct RawStderr;

impl Write for RawStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let stderr = io::stderr();
        // `as_fd` borrows fd 2 without taking the stdio lock.
        match nix::unistd::write(stderr.as_fd(), buf) {
            Ok(n) => Ok(n),
            // Dropped: a log line must never fail the call.
            Err(_) => Ok(buf.len()),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn raw_stderr() -> RawStderr {
    RawStderr
}

/// The log file, written through `&File` (each event is one append; no mutex needed).
struct LogFile(File);

impl<'a> MakeWriter<'a> for LogFile {
    type Writer = LogFileWriter<'a>;
    fn make_writer(&'a self) -> Self::Writer {
        LogFileWriter(&self.0)
    }
}

struct LogFileWriter<'a>(&'a File);

impl Write for LogFileWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // A full disk or a failing device drops the line instead of failing the call.
        Ok(self.0.write(buf).unwrap_or(buf.len()))
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct CalicoFormat {
    component: &'static str,
}

impl<S, N> FormatEvent<S, N> for CalicoFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let (secs, nanos) = crate::timefmt::now();
        let ts = crate::timefmt::go_time_string(secs, 0);
        let meta = event.metadata();
        let file = meta
            .file()
            .and_then(|f| f.strip_prefix("src/"))
            .unwrap_or("?");
        // logrus's level names.
        let level = match *meta.level() {
            Level::ERROR => "ERROR",
            Level::WARN => "WARNING",
            Level::INFO => "INFO",
            _ => "DEBUG",
        };
        write!(
            writer,
            "{}.{:03} [{}][{}] {}/{} {}: ",
            &ts[..19],
            nanos / 1_000_000,
            level,
            std::process::id(),
            self.component,
            file,
            meta.line().unwrap_or(0)
        )?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Installs the global subscriber for this process. `component` is `cni-plugin` or `ipam`.
/// A second call in one process (calico running calico-ipam in-process) changes nothing,
/// and does nothing: the log file is not opened again.
pub fn init(conf: &NetConf, component: &'static str) {
    if tracing::dispatcher::has_been_set() {
        return;
    }
    let level = parse_level(&conf.log_level);
    let file = if conf.log_file_path.is_empty() {
        None
    } else {
        let max_size = u64::try_from(conf.log_file_max_size)
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or(100)
            * 1024
            * 1024;
        let max_count = u32::try_from(conf.log_file_max_count)
            .ok()
            .filter(|n| *n > 0)
            .unwrap_or(10);
        match open_rotating(Path::new(&conf.log_file_path), max_size, max_count) {
            Ok(f) => Some(f),
            Err(e) => {
                // Upstream logs this and goes on with stderr only.
                let _ = RawStderr.write(
                    format!("Failed to open CNI log file {}: {e}\n", conf.log_file_path).as_bytes(),
                );
                None
            }
        }
    };
    let writer = match file {
        Some(f) => BoxMakeWriter::new(raw_stderr.and(LogFile(f))),
        None => BoxMakeWriter::new(raw_stderr),
    };
    // Our writers never fail, and internal errors must not go to a locked stderr. Only our
    // own events are logged (as upstream logs only Calico's), at `log_level`.
    let layer = tracing_subscriber::fmt::layer()
        .log_internal_errors(false)
        .event_format(CalicoFormat { component })
        .with_writer(writer)
        .with_filter(Targets::new().with_target(env!("CARGO_CRATE_NAME"), level));
    // A second init in one process (tests, in-process IPAM) is harmless.
    let _ = tracing_subscriber::registry().with(layer).try_init();
}

/// Creates the missing directories of `dir` with mode 0755 regardless of the umask.
fn create_log_dirs(dir: &Path) -> io::Result<()> {
    if dir.as_os_str().is_empty() || dir.exists() {
        return Ok(());
    }
    if let Some(parent) = dir.parent() {
        create_log_dirs(parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(LOG_DIR_MODE)),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// Opens `path` for appending, creating it with mode 0644 regardless of the umask.
fn open_append(path: &Path) -> io::Result<File> {
    let existed = path.exists();
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(LOG_FILE_MODE)
        .open(path)?;
    if !existed {
        let _ = file.set_permissions(fs::Permissions::from_mode(LOG_FILE_MODE));
    }
    Ok(file)
}

/// Opens the log file for appending (directories created 0755, file 0644), first rotating
/// it when it has grown past `max_size`: `cni.log` → `cni.log.1` → … → `cni.log.<count>`.
fn open_rotating(path: &Path, max_size: u64, max_count: u32) -> io::Result<File> {
    if let Some(dir) = path.parent() {
        create_log_dirs(dir)?;
    }
    let file = open_append(path)?;
    if !file.metadata()?.is_file() || file.metadata()?.len() < max_size {
        return Ok(file);
    }
    // Many CNI processes may start at once: only the one holding the lock rotates.
    let locked = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock);
    let Ok(locked) = locked else {
        return open_append(path);
    };
    if fs::metadata(path)?.len() >= max_size {
        let name = path.display().to_string();
        let _ = fs::remove_file(format!("{name}.{max_count}"));
        for i in (1..max_count).rev() {
            let _ = fs::rename(format!("{name}.{i}"), format!("{name}.{}", i + 1));
        }
        fs::rename(path, format!("{name}.1"))?;
    }
    drop(locked);
    open_append(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(parse_level("DEBUG"), Level::DEBUG);
        assert_eq!(parse_level("Error"), Level::ERROR);
        assert_eq!(parse_level("bogus"), Level::INFO);
        // v3.32.1 knows only debug, info and error.
        assert_eq!(parse_level("warn"), Level::INFO);
        assert_eq!(parse_level("trace"), Level::INFO);
    }

    #[test]
    fn modes_do_not_follow_the_umask() {
        let dir = std::env::temp_dir().join(format!("logmode-{}", std::process::id()));
        let path = dir.join("a").join("b").join("cni.log");
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
        let f = open_rotating(&path, 1024, 3);
        nix::sys::stat::umask(old);
        drop(f.unwrap());
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&path), 0o644);
        assert_eq!(mode(&dir.join("a")), 0o755);
        assert_eq!(mode(&dir.join("a").join("b")), 0o755);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failing_file_write_is_dropped() {
        // /dev/full fails every write with ENOSPC.
        let f = OpenOptions::new().append(true).open("/dev/full").unwrap();
        let mut w = LogFileWriter(&f);
        assert_eq!(w.write(b"line\n").unwrap(), 5);
    }

    #[test]
    fn rotation_by_size() {
        let dir = std::env::temp_dir().join(format!("logrot-{}", std::process::id()));
        let path = dir.join("cni.log");
        fs::create_dir_all(&dir).unwrap();
        fs::write(&path, vec![b'x'; 2048]).unwrap();
        let f = open_rotating(&path, 1024, 3).unwrap();
        drop(f);
        assert_eq!(fs::metadata(&path).unwrap().len(), 0);
        assert_eq!(fs::metadata(dir.join("cni.log.1")).unwrap().len(), 2048);
        fs::remove_dir_all(&dir).unwrap();
    }
}
