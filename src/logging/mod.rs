//! Logging with `tracing`, as upstream's `ConfigureLogging` (v3.32.1): every event at
//! `log_level` goes to stderr and, only when `log_file_path` is set, to that file as well,
//! rotated, pruned and compressed as upstream's timberjack logger does (`rotate`: the same
//! file names, so either prunes the other's backups). Lines look like Calico's:
//! `2026-01-02 03:04:05.678 [INFO][1234] cni-plugin/add.rs 42: msg k=v`.
//!
//! Logging never blocks, fails or slows a call: stderr is written with one `write(2)` per
//! event on fd 2 (no process-wide stdio lock, so helper threads can log while the main
//! thread waits for them), the file through its own descriptor, and a failed write (a full
//! disk, a closed pipe) is dropped: the first failure of the file is reported on stderr
//! (upstream's logrus reports every one), stderr's never. Never log secrets: callers log
//! config summaries, not raw stdin.

pub mod rotate;

use std::fmt;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::Mutex;

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
use rotate::{Limits, RotatingFile};

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

/// The log file: one event is one `write_line` (a rotation, when due, happens inside it,
/// under the mutex, so threads of one process never rotate twice).
struct LogFile {
    file: Mutex<RotatingFile>,
    /// Whether a failure was reported already (once per process).
    reported: std::sync::atomic::AtomicBool,
}

impl<'a> MakeWriter<'a> for LogFile {
    type Writer = LogFileWriter<'a>;
    fn make_writer(&'a self) -> Self::Writer {
        LogFileWriter(self)
    }
}

struct LogFileWriter<'a>(&'a LogFile);

impl Write for LogFileWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        // A full disk or a failing device drops the line instead of failing the call.
        let Ok(mut file) = self.0.file.lock() else {
            return Ok(buf.len());
        };
        let mut problems = Vec::new();
        let result = file.write_line(buf, &mut |p| problems.push(p.to_string()));
        drop(file);
        // The mill's problems are reported as timberjack reports them.
        for p in problems {
            let _ = RawStderr.write(format!("timberjack: {p}\n").as_bytes());
        }
        if let Err(e) = result {
            let first = !self
                .0
                .reported
                .swap(true, std::sync::atomic::Ordering::Relaxed);
            if first {
                let _ = RawStderr.write(format!("Failed to write to log, {e}\n").as_bytes());
            }
        }
        Ok(buf.len())
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
        let (secs, nanos) = crate::support::timefmt::now();
        let ts = crate::support::timefmt::go_time_string(secs, 0);
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
    let file = (!conf.log_file_path.is_empty()).then(|| {
        let path = Path::new(&conf.log_file_path);
        // Upstream creates the directory at once (the file waits for the first line).
        if let Some(dir) = path.parent() {
            if let Err(e) = rotate::create_dirs(dir) {
                let _ = RawStderr.write(
                    format!(
                        "Failed to create path for CNI log file: {}: {e}\n",
                        dir.display()
                    )
                    .as_bytes(),
                );
            }
        }
        let limits = Limits::from_conf(
            conf.log_file_max_size,
            conf.log_file_max_age,
            conf.log_file_max_count,
        );
        LogFile {
            file: Mutex::new(RotatingFile::new(path, limits)),
            reported: Default::default(),
        }
    });
    let writer = match file {
        Some(f) => BoxMakeWriter::new(raw_stderr.and(f)),
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
    fn a_failing_file_write_is_dropped() {
        // /dev/full fails every write with ENOSPC.
        let f = LogFile {
            file: Mutex::new(RotatingFile::new(
                Path::new("/dev/full"),
                Limits::from_conf(0, 0, 0),
            )),
            reported: Default::default(),
        };
        let mut w = f.make_writer();
        assert_eq!(w.write(b"line\n").unwrap(), 5);
        assert_eq!(w.write(b"line\n").unwrap(), 5);
    }
}
