//! Running the IPAM plugin named in `ipam.type` (libcni `ipam.ExecAdd/ExecDel`): found in
//! CNI_PATH, fed the same stdin, the same environment except CNI_COMMAND (and CNI_ARGS with
//! `IgnoreUnknown=1` prepended), its result parsed from any CNI version and its error JSON
//! passed through unchanged. When `ipam.type` is `calico-ipam` and that file is this very
//! binary, the IPAM runs in-process on the already open datastore: the same code and the
//! same stdin, without a second process start and datastore connection, and with the NetConf
//! and identifiers the caller has already made of that stdin (`ipam::plugin::Known`).
//!
//! A child plugin runs within the call's deadline (`crate::deadline`): it is given a budget
//! (`CALICO_CALL_TIMEOUT_SECONDS`) of what is left minus the grace, in whole seconds and at
//! least 1, so that a calico-ipam child gives up and undoes its own work before ours ends;
//! one still running at the deadline is killed and reaped, and the call fails.
//!
//! host-local DEL gets upstream's `DeleteIPAM` rewrite: `usePodCidr`/`usePodCidrIPv6`
//! subnets become `0.0.0.0/0`/`::/0` (host-local releases by container ID; it only needs a
//! valid CIDR).

use std::io::{Read, Write};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Mutex};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::config::NetConf;
use crate::datastore::Datastore;
use crate::error::{Error, Result};
use crate::ipam::plugin::{Known, Prepared};
use crate::plugin::Call;
use crate::skel::{CmdArgs, CniError, CniResult};

/// CHECK, STATUS or GC of an external IPAM plugin: same stdin, no output expected; its CNI
/// error is passed through.
pub fn exec_verb(plugin: &str, command: &str, args: &CmdArgs) -> Result<()> {
    exec(plugin, command, args, &args.stdin_data).map(|_| ())
}

/// Locates `plugin` in the colon-separated CNI_PATH.
pub fn find_plugin(plugin: &str, cni_path: &str) -> Result<PathBuf> {
    let dirs: Vec<&str> = cni_path.split(':').filter(|d| !d.is_empty()).collect();
    if plugin.is_empty() || plugin.contains('/') {
        return Err(Error::msg(format!("invalid plugin name: {plugin:?}")));
    }
    for d in &dirs {
        let p = PathBuf::from(d).join(plugin);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(Error::msg(format!(
        "failed to find plugin \"{plugin}\" in path [{}]",
        dirs.join(" ")
    )))
}

fn exec(plugin: &str, command: &str, args: &CmdArgs, stdin: &[u8]) -> Result<Vec<u8>> {
    let path = find_plugin(plugin, &args.path)?;
    debug!(plugin = %path.display(), command, "executing IPAM plugin");
    let what = format!("running the IPAM plugin {} ({command})", path.display());
    crate::deadline::check(what.as_str())?;
    let mut cmd = Command::new(&path);
    let left = crate::deadline::remaining();
    if left != Duration::MAX {
        let budget = left.saturating_sub(crate::deadline::GRACE).as_secs().max(1);
        cmd.env(crate::deadline::ENV, budget.to_string());
    }
    let mut child = cmd
        .env("CNI_COMMAND", command)
        .env("CNI_CONTAINERID", &args.container_id)
        .env("CNI_NETNS", &args.netns)
        .env("CNI_IFNAME", &args.ifname)
        .env(
            "CNI_ARGS",
            crate::skel::args::prepend_ignore_unknown(&args.args),
        )
        .env("CNI_PATH", &args.path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| Error::msg(format!("failed to execute {}: {e}", path.display())))?;
    let out = wait_for_child(&mut child, &path, stdin, &what)?;
    if out.status.success() {
        return Ok(out.stdout);
    }
    // A plugin error is a CNI error object on stdout; pass it through as it is.
    match serde_json::from_slice::<serde_json::Value>(&out.stdout) {
        Ok(v) if v.get("code").is_some() => Err(Error::Cni(CniError::new(
            v.get("code").and_then(|c| c.as_u64()).unwrap_or(999) as u32,
            v.get("msg").and_then(|m| m.as_str()).unwrap_or_default(),
            v.get("details")
                .and_then(|m| m.as_str())
                .unwrap_or_default(),
        ))),
        _ => Err(Error::msg(format!(
            "netplugin failed: \"{}\"",
            String::from_utf8_lossy(&out.stdout).trim()
        ))),
    }
}

/// What a finished child left.
struct ChildOutput {
    status: ExitStatus,
    stdout: Vec<u8>,
}

/// Feeds the child its stdin and collects its stdout on helper threads (a child that stops
/// reading or writing must not block us), and waits for it until the call's limit; a child
/// still running then is killed and reaped.
fn wait_for_child(child: &mut Child, path: &Path, stdin: &[u8], what: &str) -> Result<ChildOutput> {
    let limit = crate::deadline::limit();
    let writer = child.stdin.take().map(|mut input| {
        let data = stdin.to_vec();
        std::thread::spawn(move || input.write_all(&data))
    });
    let (tx, rx) = mpsc::channel();
    if let Some(mut output) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = tx.send(output.read_to_end(&mut buf).map(|_| buf));
        });
    } else {
        let _ = tx.send(Ok(Vec::new()));
    }
    let waited =
        |e: std::io::Error| Error::msg(format!("failed waiting for {}: {e}", path.display()));
    let status = match limit {
        None => child.wait().map_err(waited)?,
        Some(limit) => {
            // Polled (1 ms, doubling to 20 ms): a quick plugin costs next to nothing extra.
            let mut pause = Duration::from_millis(1);
            loop {
                if let Some(status) = child.try_wait().map_err(waited)? {
                    break status;
                }
                let now = Instant::now();
                if now >= limit {
                    warn!(plugin = %path.display(), "killing the IPAM plugin at the call's deadline");
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(crate::deadline::expired(what).into());
                }
                std::thread::sleep(pause.min(limit - now));
                pause = (pause * 2).min(Duration::from_millis(20));
            }
        }
    };
    if let Some(Ok(Err(e))) = writer.map(|w| w.join()) {
        return Err(Error::msg(format!(
            "failed to write to {}: {e}",
            path.display()
        )));
    }
    // The pipe closes when the child exits, unless it left a process holding it open. (A
    // moment's floor: the reader may not have sent what the child wrote just before exiting.)
    let read = match limit {
        None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
        Some(limit) => rx.recv_timeout(
            limit
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(50)),
        ),
    };
    let stdout = match read {
        Ok(Ok(buf)) => buf,
        Ok(Err(e)) => return Err(waited(e)),
        Err(mpsc::RecvTimeoutError::Timeout) => return Err(crate::deadline::expired(what).into()),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            return Err(Error::msg(format!(
                "failed reading the output of {}",
                path.display()
            )))
        }
    };
    Ok(ChildOutput { status, stdout })
}

/// Whether `plugin` in CNI_PATH is this executable under its IPAM name (then it runs
/// in-process). The answer is kept for the rest of the call (one process is one call), so
/// the lookup and the two path resolutions are made once, not at every step that asks.
pub fn is_own_ipam(plugin: &str, cni_path: &str) -> bool {
    if plugin != "calico-ipam" {
        return false;
    }
    static SEEN: Mutex<Option<(String, bool)>> = Mutex::new(None);
    if let Ok(seen) = SEEN.lock() {
        if let Some((path, own)) = seen.as_ref().filter(|(p, _)| p == cni_path) {
            debug!(cni_path = %path, own, "calico-ipam lookup (kept)");
            return *own;
        }
    }
    let own = resolve_own_ipam(plugin, cni_path);
    if let Ok(mut seen) = SEEN.lock() {
        *seen = Some((cni_path.to_string(), own));
    }
    own
}

/// The same file: the plugin found (through its symlinks) and this executable
/// (`/proc/self/exe`) have the same device and inode. Two `stat`s, where resolving both
/// paths component by component took a dozen `readlink`s.
fn resolve_own_ipam(plugin: &str, cni_path: &str) -> bool {
    use std::os::unix::fs::MetadataExt;
    let Ok(found) = find_plugin(plugin, cni_path) else {
        return false;
    };
    match (
        std::fs::metadata(found),
        std::fs::metadata("/proc/self/exe"),
    ) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// What `call` has made of `args`, when `args` carries the very stdin it was parsed from
/// (ADD rewrites the IPAM's stdin for some pod annotations: that one is parsed anew).
fn known<'a>(call: &'a Call, args: &CmdArgs) -> Option<Known<'a>> {
    (args.stdin_data == call.stdin).then_some(Known {
        conf: &call.conf,
        ids: &call.ids,
    })
}

/// The arguments the IPAM plugin sees (calico runs with `IgnoreUnknown=1` prepended).
fn ipam_args(args: &CmdArgs) -> CmdArgs {
    CmdArgs {
        args: crate::skel::args::prepend_ignore_unknown(&args.args),
        ..args.clone()
    }
}

/// IPAM ADD: the plugin's result, converted to the 1.0 model. In-process calico-ipam gets
/// what the caller has already parsed, read and locked (a separate calico-ipam does it
/// itself).
pub async fn exec_add(
    call: &Call,
    plugin: &str,
    args: &CmdArgs,
    prepared: Prepared,
) -> Result<CniResult> {
    if is_own_ipam(plugin, &args.path) {
        debug!("running calico-ipam ADD in-process");
        let known = known(call, args);
        // Boxed (as below): the IPAM's state machine is large, and the poll functions of
        // every future holding it inline reserve (and probe, page by page) stack for it.
        let ipam_args = ipam_args(args);
        let add = crate::ipam::plugin::add_with(&call.ds, known, &ipam_args, prepared);
        return Box::pin(add).await;
    }
    drop(prepared);
    let out = exec(plugin, "ADD", args, &args.stdin_data)?;
    Ok(CniResult::parse(&out)?)
}

/// IPAM DEL.
pub async fn exec_del(call: &Call, plugin: &str, args: &CmdArgs) -> Result<()> {
    del(&call.ds, known(call, args), plugin, args).await
}

/// IPAM DEL, in-process with what the caller knows, if anything.
async fn del<D: Datastore>(
    ds: &D,
    known: Option<Known<'_>>,
    plugin: &str,
    args: &CmdArgs,
) -> Result<()> {
    if is_own_ipam(plugin, &args.path) {
        debug!("running calico-ipam DEL in-process");
        let ipam_args = ipam_args(args);
        return Box::pin(crate::ipam::plugin::del_with(ds, known, &ipam_args)).await;
    }
    if plugin == "host-local" {
        let stdin = host_local_del_stdin(&args.stdin_data)?;
        return exec(plugin, "DEL", args, &stdin).map(|_| ());
    }
    exec(plugin, "DEL", args, &args.stdin_data).map(|_| ())
}

/// upstream's `ReplaceHostLocalIPAMPodCIDRs` with the dummy CIDRs DEL uses: `usePodCidr`
/// (any case) → `0.0.0.0/0`, `usePodCidrIPv6` → `::/0`, in `ipam.subnet` and in every
/// `ipam.ranges[][].subnet`; everything else kept.
pub fn host_local_del_stdin(stdin: &[u8]) -> Result<Vec<u8>> {
    rewrite_pod_cidr_subnets(stdin, |v6| {
        Ok(if v6 { "::/0" } else { "0.0.0.0/0" }.to_string())
    })
}

/// Whether host-local's config asks for the node's pod CIDR (`usePodCidr`, `usePodCidrIPv6`).
pub fn uses_pod_cidr(stdin: &[u8]) -> bool {
    let mut found = false;
    let _ = rewrite_pod_cidr_subnets(stdin, |_| {
        found = true;
        Ok(String::new())
    });
    found
}

/// host-local ADD (`ReplaceHostLocalIPAMPodCIDRs`): `usePodCidr` → the node's IPv4 pod CIDR,
/// `usePodCidrIPv6` → its IPv6 one.
pub fn host_local_add_stdin(stdin: &[u8], v4: &str, v6: &str) -> Result<Vec<u8>> {
    rewrite_pod_cidr_subnets(stdin, |want_v6| match (want_v6, v4, v6) {
        (false, "", _) => Err(Error::msg(
            "usePodCidr found but there is no IPv4 CIDR configured",
        )),
        (true, _, "") => Err(Error::msg(
            "usePodCidrIPv6 found but there is no IPv6 CIDR configured",
        )),
        (false, v4, _) => Ok(v4.to_string()),
        (true, _, v6) => Ok(v6.to_string()),
    })
}

/// Replaces each `usePodCidr` (`subst(false)`) / `usePodCidrIPv6` (`subst(true)`) subnet, in
/// `ipam.subnet` and every `ipam.ranges[][].subnet`, with upstream's parse errors.
fn rewrite_pod_cidr_subnets(
    stdin: &[u8],
    mut subst: impl FnMut(bool) -> Result<String>,
) -> Result<Vec<u8>> {
    let mut conf: serde_json::Value = serde_json::from_slice(stdin)
        .map_err(|e| Error::msg(format!("failed to parse network config: {e}")))?;
    let Some(ipam) = conf.get_mut("ipam") else {
        return Err(Error::msg(
            "failed to parse host-local IPAM data; was expecting a dict, not: <nil>",
        ));
    };
    let shown = ipam.to_string();
    let serde_json::Value::Object(ipam) = ipam else {
        return Err(Error::msg(format!(
            "failed to parse host-local IPAM data; was expecting a dict, not: {shown}"
        )));
    };
    let mut replace = |obj: &mut serde_json::Map<String, serde_json::Value>| -> Result<()> {
        let Some(serde_json::Value::String(subnet)) = obj.get("subnet") else {
            return Ok(());
        };
        let v6 = if subnet.eq_ignore_ascii_case("usePodCidr") {
            false
        } else if subnet.eq_ignore_ascii_case("usePodCidrIPv6") {
            true
        } else {
            return Ok(());
        };
        obj.insert("subnet".into(), serde_json::Value::from(subst(v6)?));
        Ok(())
    };
    replace(ipam)?;
    match ipam.get_mut("ranges") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(sets)) => {
            for set in sets {
                let shown = set.to_string();
                let serde_json::Value::Array(ranges) = set else {
                    return Err(Error::msg(format!(
                        "failed to parse host-local IPAM range set; was expecting a list, not: {shown}"
                    )));
                };
                for r in ranges {
                    let shown = r.to_string();
                    let serde_json::Value::Object(r) = r else {
                        return Err(Error::msg(format!(
                            "failed to parse host-local IPAM data; was expecting a dict, not: {shown}"
                        )));
                    };
                    replace(r)?;
                }
            }
        }
        Some(other) => {
            return Err(Error::msg(format!(
                "failed to parse host-local IPAM ranges section; was expecting a list, not: {other}"
            )))
        }
    }
    serde_json::to_vec(&conf).map_err(|e| Error::msg(e.to_string()))
}

/// The rollback of a failed ADD: give back exactly `addresses`. With Calico IPAM they are
/// released by address, and only while they still belong to this call's handle, so an
/// address another ADD of the same sandbox holds under the same handle survives; any other
/// IPAM plugin only has DEL (upstream's `ReleaseIPAllocation`). Failures are only logged.
pub async fn release_assigned<D: Datastore>(
    ds: &D,
    conf: &NetConf,
    args: &CmdArgs,
    addresses: &[IpAddr],
) {
    if conf.ipam.ipam_type == "calico-ipam" {
        debug!(
            ?addresses,
            "releasing this call's addresses after a failed ADD"
        );
        if let Err(e) = Box::pin(crate::ipam::plugin::release_addresses(
            ds,
            &ipam_args(args),
            addresses,
        ))
        .await
        {
            warn!(error = %e, "failed to release IPAM allocation");
        }
        return;
    }
    release(ds, &conf.ipam.ipam_type, args).await;
}

/// Rollback after a failed ADD ("ReleaseIPAllocation"): failures are only logged.
pub async fn release<D: Datastore>(ds: &D, plugin: &str, args: &CmdArgs) {
    debug!("releasing IPAM allocation after a failed ADD");
    if let Err(e) = del(ds, None, plugin, args).await {
        warn!(error = %e, "failed to release IPAM allocation");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_local_del_uses_dummy_pod_cidrs() {
        let out = host_local_del_stdin(
            br#"{"name":"n","ipam":{"type":"host-local","subnet":"usePodCidr","ranges":[[{"subnet":"UsePodCidrIPv6"},{"subnet":"10.1.0.0/16"}]],"dataDir":"/x"}}"#,
        )
        .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(v["ipam"]["subnet"], "0.0.0.0/0");
        assert_eq!(v["ipam"]["ranges"][0][0]["subnet"], "::/0");
        assert_eq!(v["ipam"]["ranges"][0][1]["subnet"], "10.1.0.0/16");
        assert_eq!(v["ipam"]["dataDir"], "/x");
        assert!(host_local_del_stdin(br#"{"name":"n","ipam":{"ranges":"x"}}"#).is_err());
        assert!(host_local_del_stdin(br#"{"name":"n","ipam":[]}"#).is_err());
    }
}
