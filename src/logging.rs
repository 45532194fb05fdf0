//! Logging with `tracing`: warnings and errors to stderr, everything at `log_level` to
//! `log_file_path` (default /var/log/calico/cni/cni.log) with size-based rotation. Lines look
//! like Calico's: `2026-01-02 03:04:05.678 [INFO][1234] cni-plugin/add.rs 42: msg k=v`.
//! Never log secrets: callers log config summaries, not raw stdin.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::Path;
use std::sync::Mutex;

use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::writer::MakeWriterExt;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::config::{NetConf, DEFAULT_LOG_FILE};

/// Parses Calico's `log_level` (case-insensitive; anything unknown means info).
pub fn parse_level(s: &str) -> Level {
    match s.to_ascii_lowercase().as_str() {
        "trace" => Level::TRACE,
        "debug" => Level::DEBUG,
        "warn" | "warning" => Level::WARN,
        "error" | "fatal" | "panic" => Level::ERROR,
        _ => Level::INFO,
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
        write!(
            writer,
            "{}.{:03} [{}][{}] {}/{} {}: ",
            &ts[..19],
            nanos / 1_000_000,
            meta.level(),
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
pub fn init(conf: &NetConf, component: &'static str) {
    let level = parse_level(&conf.log_level);
    let path = if conf.log_file_path.is_empty() {
        DEFAULT_LOG_FILE
    } else {
        &conf.log_file_path
    };
    let max_size = if conf.log_file_max_size > 0 {
        conf.log_file_max_size as u64
    } else {
        100
    } * 1024
        * 1024;
    let max_count = if conf.log_file_max_count > 0 {
        conf.log_file_max_count as u32
    } else {
        10
    };
    let max_level = std::cmp::max(level, Level::WARN);
    let stderr = io::stderr.with_max_level(Level::WARN);
    let result = match open_rotating(Path::new(path), max_size, max_count) {
        Ok(file) => tracing_subscriber::fmt()
            .event_format(CalicoFormat { component })
            .with_max_level(max_level)
            .with_writer(stderr.and(Mutex::new(file).with_max_level(level)))
            .try_init(),
        Err(e) => {
            let r = tracing_subscriber::fmt()
                .event_format(CalicoFormat { component })
                .with_max_level(Level::WARN)
                .with_writer(stderr)
                .try_init();
            tracing::warn!(path, error = %e, "cannot open the log file, logging to stderr only");
            r
        }
    };
    // A second init in one process (tests) is harmless.
    let _ = result;
}

/// Opens the log file for appending (directories created 0755, file 0644), first rotating
/// it when it has grown past `max_size`: `cni.log` → `cni.log.1` → … → `cni.log.<count>`.
fn open_rotating(path: &Path, max_size: u64, max_count: u32) -> io::Result<File> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    let file = OpenOptions::new().create(true).append(true).open(path)?;
    if file.metadata()?.len() < max_size {
        return Ok(file);
    }
    // Many CNI processes may start at once: only the one holding the lock rotates.
    let locked = nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock);
    let Ok(locked) = locked else {
        return OpenOptions::new().append(true).open(path);
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
    OpenOptions::new().create(true).append(true).open(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels() {
        assert_eq!(parse_level("DEBUG"), Level::DEBUG);
        assert_eq!(parse_level("Error"), Level::ERROR);
        assert_eq!(parse_level("bogus"), Level::INFO);
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
