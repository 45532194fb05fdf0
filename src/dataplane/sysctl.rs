//! Writing /proc/sys values. /proc/sys/net belongs to the netns of the thread that opens the
//! file, so callers write from a thread inside the namespace they mean.

use std::io::Write;

/// Writes `value` to a /proc/sys path (dotted names are accepted too).
pub fn write(path: &str, value: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
    f.write_all(value.as_bytes())
}

/// `net.ipv4.conf.x.y` for `/proc/sys/net/ipv4/conf/x/y`, as upstream's messages show it.
pub fn dotted(path: &str) -> String {
    path.trim_start_matches("/proc/sys/").replace('/', ".")
}

/// Writes and maps failures to upstream's "failed to set a.b.c=v: err" text.
pub fn set(path: &str, value: &str) -> Result<(), String> {
    write(path, value).map_err(|e| format!("failed to set {}={value}: {e}", dotted(path)))
}
