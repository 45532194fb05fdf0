//! Running the IPAM plugin named in `ipam.type` (libcni `ipam.ExecAdd/ExecDel`): found in
//! CNI_PATH, fed the same stdin, the same environment except CNI_COMMAND (and CNI_ARGS with
//! `IgnoreUnknown=1` prepended), its result parsed from any CNI version. A plugin that fails
//! is libcni's error of it (`super::plugin_error`): its own error object passed through, or
//! libcni's words for its exit, its stderr or its undecodable stdout, with libcni's codes. A
//! plugin whose file is busy (being written) is started again a second later, up to five
//! times, as libcni's code means to (upstream's build gives up: docs/differences.md).
//!
//! A child plugin runs within the call's deadline (`crate::support::deadline`): it is given a budget
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

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, Command};
use tracing::{debug, error, info, warn};

use super::azure;
use super::plugin_error::{ExecFailure, PluginError};
use super::{DelegateError, Result};
use crate::skel::{CmdArgs, CniResult};
use crate::support::gocompat;
use crate::support::gojson::{self, GoJsonError};

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
            return parse_result(&out, &args.stdin_data);
        };
        info!("Configured to use Azure IPAM, check for subnet");
        let net = store.load_network(network)?;
        let stdin = azure::add_stdin(&args.stdin_data, &net)?;
        let out = exec(&self.plugin, "ADD", args, &stdin).await?;
        let result = parse_result(&out, &stdin)?;
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
            true => Ok(host_local_del_stdin(&args.stdin_data)?),
            false => Ok(args.stdin_data.clone()),
        }
    }
}

/// Locates `plugin` in the colon-separated CNI_PATH (libcni's `FindInPath`: texts, order,
/// and the path as `filepath.Join` makes it).
pub fn find_plugin(plugin: &str, cni_path: &str) -> Result<PathBuf, FindError> {
    let dirs: Vec<&str> = cni_path.split(':').filter(|d| !d.is_empty()).collect();
    if plugin.is_empty() {
        return Err(FindError::NoName);
    }
    if plugin.contains('/') {
        return Err(FindError::InvalidName(plugin.to_string()));
    }
    if dirs.is_empty() {
        return Err(FindError::NoPaths);
    }
    for d in &dirs {
        let p = gocompat::clean_path(&Path::new(d).join(plugin));
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(FindError::NotInPath {
        plugin: plugin.to_string(),
        dirs: dirs.join(" "),
    })
}

/// libcni's `FindInPath` refusing (its texts).
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("no plugin name provided")]
    NoName,
    #[error("invalid plugin name: {0}")]
    InvalidName(String),
    #[error("no paths provided")]
    NoPaths,
    #[error("failed to find plugin \"{plugin}\" in path [{dirs}]")]
    NotInPath { plugin: String, dirs: String },
}

/// libcni's `RawExec`: a plugin whose file is open for writing (`text file busy`: it is being
/// installed) is started again a second later, up to five more times, within the call's
/// deadline.
const BUSY_RETRIES: u32 = 5;
const BUSY_WAIT: Duration = Duration::from_secs(1);

/// Runs the plugin for `command` with `stdin`: its stdout when it succeeds (what it wrote to
/// stderr then goes to ours, as libcni passes it on), else libcni's error of it
/// (`PluginError`).
async fn exec(plugin: &str, command: &str, args: &CmdArgs, stdin: &[u8]) -> Result<Vec<u8>> {
    let path = find_plugin(plugin, &args.path)?;
    debug!(plugin = %path.display(), command, "executing IPAM plugin");
    let what = format!("running the IPAM plugin {} ({command})", path.display());
    let mut child = start(&path, command, args, &what).await?;
    let out = wait_for_child(&mut child, &path, stdin, &what).await?;
    if !out.status.success() {
        let failure = ExecFailure::Exited(out.status);
        return Err(PluginError::from_output(failure, out.stdout, out.stderr).into());
    }
    // Go's exec reports a failed copy only for a plugin that succeeded; a plugin that exits
    // without reading its input (EPIPE) is not one (`skipStdinCopyError`).
    out.written.map_err(|source| DelegateError::Io {
        what: "failed to write to",
        path: path.clone(),
        source,
    })?;
    if !out.stderr.is_empty() {
        let _ = std::io::stderr().write_all(&out.stderr);
    }
    Ok(out.stdout)
}

/// Starts the plugin, trying again while its file is busy (`BUSY_RETRIES`). A plugin that
/// cannot be started is libcni's `netplugin failed with no error message: fork/exec ...`.
async fn start(path: &Path, command: &str, args: &CmdArgs, what: &str) -> Result<Child> {
    let mut retries = 0;
    loop {
        crate::support::deadline::check(what)?;
        match plugin_command(path, command, args).spawn() {
            Ok(child) => return Ok(child),
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) && retries < BUSY_RETRIES => {
                retries += 1;
                warn!(plugin = %path.display(), retries,
                    "the IPAM plugin's file is busy (being written): trying again in a second");
                let (at, capped) = crate::support::deadline::cap_at(BUSY_WAIT);
                tokio::time::sleep_until(at).await;
                if capped {
                    return Err(crate::support::deadline::expired(format!(
                        "waiting to run the IPAM plugin {} ({command}), whose file is busy",
                        path.display()
                    ))
                    .into());
                }
            }
            Err(source) => {
                let path = path.to_path_buf();
                return Err(PluginError::Silent(ExecFailure::Start { path, source }).into());
            }
        }
    }
}

/// The plugin's command: the same environment as ours but the CNI variables of this call
/// (CNI_ARGS with `IgnoreUnknown=1` first), and the budget of the call's deadline.
fn plugin_command(path: &Path, command: &str, args: &CmdArgs) -> Command {
    let mut cmd = Command::new(path);
    let left = crate::support::deadline::remaining();
    if left != Duration::MAX {
        let budget = left
            .saturating_sub(crate::support::deadline::GRACE)
            .as_secs()
            .max(1);
        cmd.env(crate::support::deadline::ENV, budget.to_string());
    }
    cmd.env("CNI_COMMAND", command)
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
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// The CNI versions a result can be decoded in (libcni's registered creators).
const RESULT_VERSIONS: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The result of a plugin that succeeded, as libcni's `ExecPluginWithResult` reads it
/// (`fixupResultVersion`, then `create.Create`): a JSON object (or `null`), else `failed to
/// unmarshal raw result: <Go's JSON error>`; without a `cniVersion` (or with an empty one) it
/// is in the version of the config `netconf`; a version libcni does not know is
/// `unsupported CNI result version "<v>"`.
fn parse_result(out: &[u8], netconf: &[u8]) -> Result<CniResult> {
    let raw = DelegateError::RawResult;
    gojson::check_syntax(out).map_err(|e| raw(e.into()))?;
    let mut v: serde_json::Value = serde_json::from_slice(out)?;
    let obj = match &mut v {
        serde_json::Value::Null => {
            v = serde_json::Value::Object(Default::default());
            v.as_object_mut()
        }
        other => other.as_object_mut(),
    };
    let Some(obj) = obj else {
        let kind = gojson::kind(&v);
        let go_type = "map[string]interface {}".to_string();
        return Err(raw(GoJsonError::Type { kind, go_type }));
    };
    let version = match obj.get("cniVersion") {
        Some(serde_json::Value::String(s)) if !s.is_empty() => s.clone(),
        _ => {
            let conf: Option<serde_json::Value> = serde_json::from_slice(netconf).ok();
            let version = conf
                .as_ref()
                .and_then(|c| c.get("cniVersion"))
                .and_then(serde_json::Value::as_str)
                .filter(|s| !s.is_empty())
                .unwrap_or("0.1.0")
                .to_string();
            obj.insert("cniVersion".into(), version.clone().into());
            version
        }
    };
    if !RESULT_VERSIONS.contains(&version.as_str()) {
        return Err(DelegateError::ResultVersion(gocompat::quote(
            version.as_bytes(),
        )));
    }
    CniResult::parse(&serde_json::to_vec(&v)?).map_err(DelegateError::Result)
}

/// What a finished child left.
struct ChildOutput {
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// Whether its input was written (a child that exits without reading it is not an error).
    written: std::io::Result<()>,
}

/// Everything from `pipe` until its end.
async fn read_pipe(pipe: Option<impl AsyncRead + Unpin>) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    if let Some(mut pipe) = pipe {
        pipe.read_to_end(&mut buf).await?;
    }
    Ok(buf)
}

/// Feeds the child its stdin and collects its stdout and stderr while waiting for it to
/// exit, until the call's limit; a child still running then is killed and reaped.
async fn wait_for_child(
    child: &mut Child,
    path: &Path,
    stdin: &[u8],
    what: &str,
) -> Result<ChildOutput> {
    let limit = crate::support::deadline::limit();
    let waited = |source: std::io::Error| DelegateError::Io {
        what: "failed waiting for",
        path: path.to_path_buf(),
        source,
    };
    let input = child.stdin.take();
    let write = async move {
        let written = match input {
            // Dropped at the end: the child sees end of input.
            Some(mut input) => input.write_all(stdin).await,
            None => Ok(()),
        };
        match written {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            other => other,
        }
    };
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let read = async move {
        let (out, err) = tokio::join!(read_pipe(stdout), read_pipe(stderr));
        Ok::<_, std::io::Error>((out?, err?))
    };
    tokio::pin!(read);
    let run = async { tokio::join!(write, child.wait()) };
    let mut read_done = None;
    let finished = async {
        // The exit and the pipes' ends are awaited together: a child whose output fills a
        // pipe only exits once it has been read.
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
                return Err(crate::support::deadline::expired(what).into());
            }
        },
    };
    let status = status.map_err(waited)?;
    // The pipes close when the child exits, unless it left a process holding them open. (A
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
                Err(_) => return Err(crate::support::deadline::expired(what).into()),
            }
        }
    };
    let (stdout, stderr) = read_done.map_err(waited)?;
    Ok(ChildOutput {
        status,
        stdout,
        stderr,
        written,
    })
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
pub fn host_local_del_stdin(stdin: &[u8]) -> Result<Vec<u8>, HostLocalConfError> {
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
pub fn host_local_add_stdin(
    stdin: &[u8],
    v4: &str,
    v6: &str,
) -> Result<Vec<u8>, HostLocalConfError> {
    rewrite_pod_cidr_subnets(stdin, |want_v6| match (want_v6, v4, v6) {
        (false, "", _) => Err(HostLocalConfError::NoIpv4Cidr),
        (true, _, "") => Err(HostLocalConfError::NoIpv6Cidr),
        (false, v4, _) => Ok(v4.to_string()),
        (true, _, v6) => Ok(v6.to_string()),
    })
}

/// Replaces each `usePodCidr` (`subst(false)`) / `usePodCidrIPv6` (`subst(true)`) subnet, in
/// `ipam.subnet` and every `ipam.ranges[][].subnet`, with upstream's parse errors.
fn rewrite_pod_cidr_subnets(
    stdin: &[u8],
    mut subst: impl FnMut(bool) -> Result<String, HostLocalConfError>,
) -> Result<Vec<u8>, HostLocalConfError> {
    let mut conf: serde_json::Value =
        serde_json::from_slice(stdin).map_err(HostLocalConfError::Parse)?;
    let Some(ipam) = conf.get_mut("ipam") else {
        return Err(HostLocalConfError::NotADict("<nil>".to_string()));
    };
    let shown = ipam.to_string();
    let serde_json::Value::Object(ipam) = ipam else {
        return Err(HostLocalConfError::NotADict(shown));
    };
    let mut replace = |obj: &mut serde_json::Map<String, serde_json::Value>| {
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
        Ok::<_, HostLocalConfError>(())
    };
    replace(ipam)?;
    match ipam.get_mut("ranges") {
        None | Some(serde_json::Value::Null) => {}
        Some(serde_json::Value::Array(sets)) => {
            for set in sets {
                let shown = set.to_string();
                let serde_json::Value::Array(ranges) = set else {
                    return Err(HostLocalConfError::RangeSetNotAList(shown));
                };
                for r in ranges {
                    let shown = r.to_string();
                    let serde_json::Value::Object(r) = r else {
                        return Err(HostLocalConfError::NotADict(shown));
                    };
                    replace(r)?;
                }
            }
        }
        Some(other) => return Err(HostLocalConfError::RangesNotAList(other.to_string())),
    }
    serde_json::to_vec(&conf).map_err(HostLocalConfError::Encode)
}

/// host-local's config refused where its `usePodCidr` subnets are rewritten (upstream's
/// texts).
#[derive(Debug, thiserror::Error)]
pub enum HostLocalConfError {
    #[error("failed to parse network config: {0}")]
    Parse(#[source] serde_json::Error),
    #[error("failed to parse host-local IPAM data; was expecting a dict, not: {0}")]
    NotADict(String),
    #[error("failed to parse host-local IPAM range set; was expecting a list, not: {0}")]
    RangeSetNotAList(String),
    #[error("failed to parse host-local IPAM ranges section; was expecting a list, not: {0}")]
    RangesNotAList(String),
    #[error("usePodCidr found but there is no IPv4 CIDR configured")]
    NoIpv4Cidr,
    #[error("usePodCidrIPv6 found but there is no IPv6 CIDR configured")]
    NoIpv6Cidr,
    #[error(transparent)]
    Encode(serde_json::Error),
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
