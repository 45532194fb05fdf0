//! Running the IPAM plugin named in `ipam.type` (libcni `ipam.ExecAdd/ExecDel`): found in
//! CNI_PATH, fed the same stdin, the same environment except CNI_COMMAND (and CNI_ARGS with
//! `IgnoreUnknown=1` prepended), its result parsed from any CNI version and its error JSON
//! passed through unchanged.
//!
//! A child plugin runs within the call's deadline (`crate::deadline`): it is given a budget
//! (`CALICO_CALL_TIMEOUT_SECONDS`) of what is left minus the grace, in whole seconds and at
//! least 1, so that a calico-ipam child gives up and undoes its own work before ours ends;
//! one still running at the deadline is killed and reaped, and the call fails. The child is
//! driven by the call's runtime (tokio's process support): its stdin, stdout and exit are
//! awaited, so the veth pair built meanwhile (`plugin::add`) is not held up by the wait.
//!
//! host-local DEL and CHECK get upstream's `DeleteIPAM` rewrite: `usePodCidr`/`usePodCidrIPv6`
//! subnets become `0.0.0.0/0`/`::/0` (host-local releases by container ID; it only needs a
//! valid CIDR).
//!
//! azure-vnet-ipam gets upstream's `AddIPAM`/`DeleteIPAM` handling (`super::azure`): ADD asks
//! for the network's stored subnet and records the subnet and the attachment's addresses;
//! DEL names the recorded address and subnet, is not sent at all when nothing is recorded
//! for the attachment, and forgets the record once the plugin has released it. The rollback
//! of a failed ADD is that DEL, on the record the ADD made.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;
use tracing::{debug, error, info, warn};

use super::azure;
use crate::error::{Context, Error, Result};
use crate::skel::{CmdArgs, CniError, CniResult};

/// An IPAM plugin run as a child process, by its `ipam.type` name.
#[derive(Clone, Debug)]
pub struct Exec {
    pub plugin: String,
    /// azure-vnet-ipam's network (the NetConf's `name`) and where its state is kept.
    azure: Option<(String, azure::Store)>,
}

impl Exec {
    /// A plugin whose verbs need nothing of the network (STATUS).
    pub fn new(plugin: &str) -> Exec {
        Exec {
            plugin: plugin.to_string(),
            azure: None,
        }
    }

    /// The plugin of network `network` (the NetConf's `name`).
    pub fn for_network(plugin: &str, network: &str) -> Exec {
        Exec {
            plugin: plugin.to_string(),
            azure: (plugin == azure::PLUGIN).then(|| (network.to_string(), Default::default())),
        }
    }

    fn is_host_local(&self) -> bool {
        self.plugin == "host-local"
    }

    /// ADD: the plugin's result, converted to the 1.0 model.
    pub async fn add(&self, args: &CmdArgs) -> Result<CniResult> {
        let Some((network, store)) = &self.azure else {
            let out = exec(&self.plugin, "ADD", args, &args.stdin_data).await?;
            return Ok(CniResult::parse(&out)?);
        };
        info!("Configured to use Azure IPAM, check for subnet");
        let net = store.load_network(network)?;
        let stdin = azure::add_stdin(&args.stdin_data, &net)?;
        let out = exec(&self.plugin, "ADD", args, &stdin).await?;
        let result = CniResult::parse(&out)?;
        if let Err(e) = store.record(network, &args.container_id, &args.ifname, &result) {
            // Without the record no DEL could name the address: it is released now, with
            // the configuration DEL would have sent.
            let recorded =
                azure::recorded_endpoint(network, &args.container_id, &args.ifname, &result);
            let subnet = result.ips.first().map(|ip| ip.address.masked().to_string());
            let net = azure::AzureNetwork {
                name: network.clone(),
                subnets: subnet.map(|s| vec![s]),
            };
            let released = match azure::del_stdin(&stdin, &net, &recorded) {
                Ok(del) => exec(&self.plugin, "DEL", args, &del).await.map(|_| ()),
                Err(e) => Err(e.into()),
            };
            if let Err(r) = released {
                warn!(error = %r, "failed to release the Azure address that could not be recorded");
            }
            return Err(e.into());
        }
        Ok(result)
    }

    /// DEL (host-local's `usePodCidr` replaced by a stand-in, as upstream; azure-vnet-ipam
    /// told the recorded address and subnet).
    pub async fn del(&self, args: &CmdArgs) -> Result<()> {
        let Some((network, store)) = &self.azure else {
            let stdin = self.by_container_stdin(args)?;
            return exec(&self.plugin, "DEL", args, &stdin).await.map(|_| ());
        };
        info!("Configured to use Azure IPAM, load network and endpoint");
        let net = store.load_network(network)?;
        let ep = store.load_endpoint(network, &args.container_id, &args.ifname)?;
        if ep.addresses().is_empty() {
            info!(network = %network, container_id = %args.container_id, ifname = %args.ifname,
                "No endpoint addresses, skip IPAM release");
            return Ok(());
        }
        let stdin = azure::del_stdin(&args.stdin_data, &net, &ep)?;
        exec(&self.plugin, "DEL", args, &stdin).await?;
        // Only once the plugin has released the address: the record is what names it.
        if let Err(e) = store.delete_endpoint(&ep) {
            error!(error = %e, "Error deleting Azure endpoint");
        }
        Ok(())
    }

    /// CHECK (host-local checks by container ID: the same stand-in as DEL).
    pub async fn check(&self, args: &CmdArgs) -> Result<()> {
        let stdin = self.by_container_stdin(args)?;
        exec(&self.plugin, "CHECK", args, &stdin).await.map(|_| ())
    }

    /// STATUS or GC: same stdin, no output expected; its CNI error is passed through.
    pub async fn verb(&self, command: &str, args: &CmdArgs) -> Result<()> {
        exec(&self.plugin, command, args, &args.stdin_data)
            .await
            .map(|_| ())
    }

    fn by_container_stdin(&self, args: &CmdArgs) -> Result<Vec<u8>> {
        match self.is_host_local() {
            true => host_local_del_stdin(&args.stdin_data),
            false => Ok(args.stdin_data.clone()),
        }
    }
}

/// Locates `plugin` in the colon-separated CNI_PATH.
pub fn find_plugin(plugin: &str, cni_path: &str) -> Result<PathBuf> {
    let dirs: Vec<&str> = cni_path.split(':').filter(|d| !d.is_empty()).collect();
    // libcni's `FindInPath`, texts and order.
    if plugin.is_empty() {
        return Err(Error::msg("no plugin name provided"));
    }
    if plugin.contains('/') {
        return Err(Error::msg(format!("invalid plugin name: {plugin}")));
    }
    if dirs.is_empty() {
        return Err(Error::msg("no paths provided"));
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

async fn exec(plugin: &str, command: &str, args: &CmdArgs, stdin: &[u8]) -> Result<Vec<u8>> {
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
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("failed to execute {}", path.display()))?;
    let out = wait_for_child(&mut child, &path, stdin, &what).await?;
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
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
}

/// Feeds the child its stdin and collects its stdout while waiting for it to exit, until the
/// call's limit; a child still running then is killed and reaped.
async fn wait_for_child(
    child: &mut tokio::process::Child,
    path: &Path,
    stdin: &[u8],
    what: &str,
) -> Result<ChildOutput> {
    let limit = crate::deadline::limit();
    let waited =
        |e: std::io::Error| Error::chain(format!("failed waiting for {}", path.display()), e);
    let input = child.stdin.take();
    let write = async move {
        match input {
            // Dropped at the end: the child sees end of input.
            Some(mut input) => input.write_all(stdin).await,
            None => Ok(()),
        }
    };
    let output = child.stdout.take();
    let read = async move {
        let mut buf = Vec::new();
        if let Some(mut o) = output {
            o.read_to_end(&mut buf).await?;
        }
        Ok::<_, std::io::Error>(buf)
    };
    tokio::pin!(read);
    let run = async { tokio::join!(write, child.wait()) };
    let mut read_done = None;
    let finished = async {
        // The exit and stdout's end are awaited together: a child whose output fills the pipe
        // only exits once it has been read.
        tokio::pin!(run);
        loop {
            tokio::select! {
                r = &mut read, if read_done.is_none() => read_done = Some(r),
                out = &mut run => return out,
            }
        }
    };
    let (written, status) = match limit {
        None => finished.await,
        Some(limit) => match tokio::time::timeout_at(limit.into(), finished).await {
            Ok(out) => out,
            Err(_) => {
                warn!(plugin = %path.display(), "killing the IPAM plugin at the call's deadline");
                let _ = child.kill().await;
                return Err(crate::deadline::expired(what).into());
            }
        },
    };
    let status = status.map_err(waited)?;
    written.with_context(|| format!("failed to write to {}", path.display()))?;
    // The pipe closes when the child exits, unless it left a process holding it open. (A
    // moment's floor: what the child wrote just before exiting may not have been read yet.)
    let read_done = match read_done {
        Some(r) => r,
        None => {
            let floor = Duration::from_millis(50);
            let wait = limit.map_or(Duration::MAX, |l| {
                l.saturating_duration_since(Instant::now()).max(floor)
            });
            match tokio::time::timeout(wait, &mut read).await {
                Ok(r) => r,
                Err(_) => return Err(crate::deadline::expired(what).into()),
            }
        }
    };
    let stdout = read_done.map_err(waited)?;
    Ok(ChildOutput { status, stdout })
}

/// Whether `plugin` in CNI_PATH is this very executable (then Calico IPAM runs in-process):
/// the plugin found (through its symlinks) and this executable (`/proc/self/exe`) have the
/// same device and inode. Two `stat`s, where resolving both paths component by component
/// took a dozen `readlink`s.
pub fn is_this_executable(plugin: &str, cni_path: &str) -> bool {
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
    let mut conf: serde_json::Value =
        serde_json::from_slice(stdin).context("failed to parse network config")?;
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
    Ok(serde_json::to_vec(&conf)?)
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
