//! The nodename file at boot (projectcalico/calico#1795). calico/node writes
//! /var/lib/calico/nodename (`nodename_file`) once it has started; upstream's ADD and DEL fail
//! at once while it is missing (unless `nodename_file_optional`), so a pod scheduled before
//! calico/node has written it fails its ADD, and a DEL of an old sandbox at boot fails too.
//!
//! * ADD waits for the file, polling, for at most half the time left before the call's
//!   deadline (the other half is for the ADD itself once the file is there), then fails with
//!   upstream's text.
//! * DEL does not wait: without the file (and without `nodename` in the NetConf) the node name
//!   is unknown, and DEL does what needs no node name (`plugin::del`).
//!
//! The gate is kept when `nodename` is set in the NetConf: the standard manifests always set
//! it (`__KUBERNETES_NODE_NAME__`), so there the file is not a source of the name but the
//! sign that calico/node has started on this node; dropping the gate would drop it from
//! nearly every deployment.

use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::config::{ConfigError, NetConf};

/// How often ADD looks for the file while it waits.
pub const POLL: Duration = Duration::from_millis(100);

/// ADD's gate: passes at once when the file exists (or is optional), else waits for it for
/// at most half the time left (`crate::support::deadline`), then fails with upstream's text.
pub async fn wait_for_file(conf: &NetConf) -> Result<(), ConfigError> {
    if conf.nodename_file_passes() {
        return Ok(());
    }
    let file = conf.nodename_file();
    // Not armed (a library caller): the default budget stands in for the deadline.
    let left = match crate::support::deadline::current() {
        Some(_) => crate::support::deadline::remaining(),
        None => crate::support::deadline::DEFAULT_BUDGET,
    };
    let bound = left / 2;
    info!(
        file,
        bound_ms = bound.as_millis() as u64,
        "the nodename file does not exist yet (calico/node has not started?); waiting for it"
    );
    match wait_until(|| conf.nodename_file_passes(), bound, POLL).await {
        Some(waited) => {
            info!(
                file,
                waited_ms = waited.as_millis() as u64,
                "the nodename file appeared"
            );
            Ok(())
        }
        None => {
            warn!(
                file,
                waited_ms = bound.as_millis() as u64,
                "the nodename file did not appear in time"
            );
            Err(ConfigError::NodenameFileMissing(file.to_string()))
        }
    }
}

/// Polls `ready` every `poll` (an async sleep: the call's runtime thread is never blocked)
/// until it holds, for at most `bound`: how long it took, or `None` when it never held.
pub async fn wait_until(
    ready: impl Fn() -> bool,
    bound: Duration,
    poll: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    loop {
        if ready() {
            return Some(start.elapsed());
        }
        let left = bound.saturating_sub(start.elapsed());
        if left.is_zero() {
            return None;
        }
        // The last sleep ends at the bound, where one more look is taken.
        tokio::time::sleep(poll.min(left)).await;
    }
}

/// DEL's node name: `None` when it is unknown, i.e. the gate fails (the file is missing and
/// not optional) and the NetConf names no `nodename`. Upstream fails such a DEL.
pub fn for_del(conf: &NetConf) -> Option<String> {
    if conf.nodename.is_empty() && !conf.nodename_file_passes() {
        warn!(
            file = conf.nodename_file(),
            "the nodename file does not exist (calico/node has not started?) and no nodename is \
             set: the node name is unknown; DEL does everything that does not need it"
        );
        return None;
    }
    Some(conf.node_name())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        crate::call::client::block_on(f).expect("runtime")
    }

    #[test]
    fn waits_until_ready_or_the_bound() {
        let polls = AtomicUsize::new(0);
        let ready_on_third = || polls.fetch_add(1, Ordering::SeqCst) >= 2;
        let waited = block_on(wait_until(
            ready_on_third,
            Duration::from_secs(5),
            Duration::from_millis(20),
        ))
        .expect("ready");
        assert!(waited >= Duration::from_millis(40), "{waited:?}");
        let start = Instant::now();
        let never = block_on(wait_until(
            || false,
            Duration::from_millis(150),
            Duration::from_millis(40),
        ));
        assert_eq!(never, None);
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(2),
            "{took:?}"
        );
        // Ready at once: no sleep; a zero bound looks once.
        let at_once = block_on(wait_until(|| true, Duration::ZERO, POLL)).expect("ready");
        assert!(at_once < Duration::from_millis(50), "{at_once:?}");
        assert_eq!(block_on(wait_until(|| false, Duration::ZERO, POLL)), None);
    }

    #[test]
    fn del_knows_the_node_only_from_the_name_or_the_file() {
        let dir = std::env::temp_dir().join(format!("nodename-del-{}", std::process::id()));
        let _ = std::fs::create_dir_all(&dir);
        let file = dir.join("nodename");
        let _ = std::fs::remove_file(&file);
        let mut conf = NetConf {
            nodename_file: file.display().to_string(),
            ..Default::default()
        };
        assert_eq!(for_del(&conf), None);
        conf.nodename = "explicit".into();
        assert_eq!(for_del(&conf).as_deref(), Some("explicit"));
        conf.nodename.clear();
        std::fs::write(&file, "from-file\n").expect("write the nodename file");
        assert_eq!(for_del(&conf).as_deref(), Some("from-file"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
