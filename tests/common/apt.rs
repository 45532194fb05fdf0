#![allow(dead_code)]
//! Installing a Debian package a suite needs when it is missing (`make test` normally has
//! already done it through the Makefile's APT_PACKAGES). Bounded, never interactive; a
//! failure is returned as the reason the suite has to skip.

use std::process::Command;
use std::time::Duration;

use super::cni::run_command_within;

/// A cold install of Go takes ~15 s here; apt may wait up to 120 s for another apt's lock.
const APT_TIMEOUT: Duration = Duration::from_secs(600);

fn apt(args: &[&str]) -> Result<(), String> {
    let mut cmd = Command::new("apt-get");
    cmd.args(args).env("DEBIAN_FRONTEND", "noninteractive");
    let out = run_command_within(cmd, "", APT_TIMEOUT, "apt-get");
    if out.code == 0 {
        Ok(())
    } else {
        let tail: Vec<&str> = out.stderr.lines().rev().take(3).collect();
        Err(format!(
            "apt-get {args:?} failed ({}): {}",
            out.code,
            tail.join(" | ")
        ))
    }
}

/// Makes `ready()` true by installing `packages` when it is not; `Err` says why not.
pub fn ensure(packages: &[&str], ready: impl Fn() -> bool) -> Result<(), String> {
    if ready() {
        return Ok(());
    }
    if let Err(e) = Command::new("apt-get").arg("--version").output() {
        return Err(format!("{packages:?} missing and apt-get cannot run: {e}"));
    }
    let mut install = vec![
        "install",
        "-y",
        "-qq",
        "--no-install-recommends",
        "-o",
        "DPkg::Lock::Timeout=120",
    ];
    install.extend_from_slice(packages);
    // The package lists may be missing or stale on a fresh machine: update once and retry.
    if let Err(first) = apt(&install) {
        apt(&["update", "-qq"]).map_err(|e| format!("{first}; then {e}"))?;
        apt(&install)?;
    }
    if ready() {
        Ok(())
    } else {
        Err(format!(
            "installed {packages:?}, but it is still not usable"
        ))
    }
}
