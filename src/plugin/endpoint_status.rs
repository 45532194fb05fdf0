//! `policy_setup_timeout_seconds` (k8s.go / pkg/wait at v3.32.1): after writing the
//! WorkloadEndpoint, ADD waits until Felix has programmed the endpoint's policy, which Felix
//! signals by creating a status file in `endpoint_status_dir` (default
//! /var/run/calico/endpoint-status) named `<orchestrator> <namespace/workload> <endpoint>`,
//! each part URL-path-escaped (e.g. `k8s default%2Fnginx eth0`). Running out of time only
//! logs a warning: the pod starts anyway, as upstream.

use std::path::Path;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::config::ConfigError;
use crate::error::Result;

pub const DEFAULT_ENDPOINT_STATUS_DIR: &str = "/var/run/calico/endpoint-status";
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The longest `policy_setup_timeout_seconds` makes ADD wait (none when not positive).
pub fn max_wait(seconds: i64) -> Duration {
    Duration::from_secs(u64::try_from(seconds).unwrap_or(0))
}

/// A negative timeout is a configuration error (upstream: `invalid pod startup delay of -1`).
pub fn validate_timeout(seconds: i64) -> Result<()> {
    if seconds < 0 {
        return Err(ConfigError::PodStartupDelay(seconds).into());
    }
    Ok(())
}

/// Go's `url.PathEscape`: everything but unreserved characters and `$&+:=@` is %-escaped.
fn path_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~$&+:=@".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Splits a WorkloadEndpoint name into its dash-separated segments (`--` is a literal `-`).
fn name_segments(name: &str) -> Vec<String> {
    let mut parts = vec![String::new()];
    let mut chars = name.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '-' {
            if chars.peek() == Some(&'-') {
                chars.next();
                if let Some(last) = parts.last_mut() {
                    last.push('-');
                }
            } else {
                parts.push(String::new());
            }
        } else if let Some(last) = parts.last_mut() {
            last.push(c);
        }
    }
    parts
}

/// The status file Felix writes for this endpoint (`WorkloadEndpointKeyToStatusFilename`).
pub fn status_filename(namespace: &str, wep_name: &str) -> Option<String> {
    let parts = name_segments(wep_name);
    let [_, orchestrator, workload, endpoint] = parts.as_slice() else {
        return None;
    };
    Some(format!(
        "{} {} {}",
        path_escape(orchestrator),
        path_escape(&format!("{namespace}/{workload}")),
        path_escape(endpoint)
    ))
}

/// Waits up to `seconds` (and no longer than the call's deadline) for the endpoint's status
/// file; only logs when it does not appear.
pub async fn wait_for_policy(dir: &str, namespace: &str, wep_name: &str, seconds: i64) {
    if seconds <= 0 {
        return;
    }
    let dir = if dir.is_empty() {
        DEFAULT_ENDPOINT_STATUS_DIR
    } else {
        dir
    };
    let Some(file) = status_filename(namespace, wep_name) else {
        warn!(
            wep_name,
            "Error waiting for endpoint to become ready. Unblocking pod creation..."
        );
        return;
    };
    let path = Path::new(dir).join(&file);
    debug!(path = %path.display(), "Waiting for workload's status file to appear");
    // ADD's deadline was extended to cover this wait (`add::configured_waits`): the cap
    // only bites where the call's own work already used the time up.
    let (wait, _) = crate::support::deadline::cap(max_wait(seconds));
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if path.exists() {
            info!(path = %path.display(), "endpoint policy is programmed");
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            warn!(
                "Error waiting for endpoint to become ready. Unblocking pod creation... timed out waiting for endpoint status file '{}': file not found",
                path.display()
            );
            return;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filenames_match_felix() {
        assert_eq!(
            status_filename("default", "node1-k8s-testpod1-eth0").as_deref(),
            Some("k8s default%2Ftestpod1 eth0")
        );
        assert_eq!(
            status_filename("ns", "node--1-k8s-my--pod-eth0").as_deref(),
            Some("k8s ns%2Fmy-pod eth0")
        );
        assert_eq!(path_escape("t est/a;b"), "t%20est%2Fa%3Bb");
        assert_eq!(status_filename("ns", "bad"), None);
        assert!(validate_timeout(-1)
            .unwrap_err()
            .to_string()
            .contains("invalid pod startup delay of -1"));
        assert!(validate_timeout(0).is_ok());
    }

    #[tokio::test]
    async fn waits_for_the_file_and_gives_up() {
        let dir = std::env::temp_dir().join(format!("epstatus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let d = dir.display().to_string();
        let start = std::time::Instant::now();
        wait_for_policy(&d, "ns", "node1-k8s-p-eth0", 1).await;
        assert!(start.elapsed() >= Duration::from_secs(1));
        std::fs::write(dir.join("k8s ns%2Fp eth0"), "").unwrap();
        let start = std::time::Instant::now();
        wait_for_policy(&d, "ns", "node1-k8s-p-eth0", 5).await;
        assert!(start.elapsed() < Duration::from_secs(1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
