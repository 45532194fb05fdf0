//! What one Calico IPAM call works with (`IpamCall`): its NetConf and identifiers, parsed from
//! its stdin or borrowed from the `calico` plugin that runs it in-process (`Known`); the
//! arguments calico-ipam sees, the `IP=` it may ask for, and upstream's 90 s budget.

use std::borrow::Cow;
use std::net::IpAddr;
use std::time::Duration;

use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::error::{ContextDeadline, Result};
use crate::skel::args::{load_args, ArgKind, IGNORE_UNKNOWN};
use crate::skel::CmdArgs;

/// Upstream's budget for one assignment or release, counted after the lock is taken.
pub const IPAM_TIMEOUT: Duration = Duration::from_secs(90);

/// `ipamArgs` of ipam_plugin.go: the second CNI_ARGS pass of ADD knows only these keys, so
/// `K8S_*` keys without `IgnoreUnknown=1` fail there (`calico` always prepends it).
const IPAM_ARGS: &[(&str, ArgKind)] = &[IGNORE_UNKNOWN, ("IP", ArgKind::Ip)];

/// What one Calico IPAM call works with: parsed from its stdin, or borrowed from the
/// `calico` plugin that runs it in-process.
pub struct IpamCall<'a> {
    pub conf: Cow<'a, NetConf>,
    pub ids: Cow<'a, WepIdentifiers>,
}

/// What the `calico` plugin has already made of the same stdin and CNI_ARGS: an in-process
/// calico-ipam uses it instead of parsing the NetConf, reading the nodename file and
/// building the identifiers again.
#[derive(Clone, Copy)]
pub struct Known<'a> {
    /// The NetConf parsed from the very stdin calico-ipam is given.
    pub conf: &'a NetConf,
    /// The identifiers from the same node name, container ID, interface and CNI_ARGS (with
    /// `IgnoreUnknown=1` prepended, as calico-ipam sees them).
    pub ids: &'a WepIdentifiers,
}

/// The arguments calico-ipam sees (calico runs with `IgnoreUnknown=1` prepended).
pub fn ipam_args(args: &CmdArgs) -> CmdArgs {
    CmdArgs {
        args: crate::skel::args::prepend_ignore_unknown(&args.args),
        ..args.clone()
    }
}

/// The node name and the identifiers (`K8sArgs`) for a parsed NetConf, and the checks both
/// the `calico-ipam` process and the in-process driver make.
pub fn identify(args: &CmdArgs, conf: NetConf, for_add: bool) -> Result<IpamCall<'static>> {
    let node = conf.node_name();
    let ids = WepIdentifiers::from_cni_args(&node, &args.container_id, &args.ifname, &args.args)?;
    checked(
        IpamCall {
            conf: Cow::Owned(conf),
            ids: Cow::Owned(ids),
        },
        for_add,
    )
}

/// ADD also needs a buildable WorkloadEndpoint name (upstream fails there before any IPAM
/// work); DEL does not, so an address allocated under a name that cannot be built is still
/// released (upstream's DEL fails there forever).
pub(super) fn checked(call: IpamCall<'_>, for_add: bool) -> Result<IpamCall<'_>> {
    if for_add {
        call.ids.wep_name()?;
    }
    Ok(call)
}

/// The in-process entry points' `load` and `identify`: what the caller knows, else parsed.
pub fn call_for<'a>(
    args: &CmdArgs,
    known: Option<Known<'a>>,
    for_add: bool,
) -> Result<IpamCall<'a>> {
    match known {
        Some(k) => checked(
            IpamCall {
                conf: Cow::Borrowed(k.conf),
                ids: Cow::Borrowed(k.ids),
            },
            for_add,
        ),
        None => identify(args, NetConf::parse(&args.stdin_data)?, for_add),
    }
}

/// The `IP=` of ADD's second CNI_ARGS pass.
pub fn requested_ip(args: &CmdArgs) -> Result<Option<IpAddr>> {
    let ipam_args = load_args(&args.args, IPAM_ARGS)?;
    Ok(ipam_args
        .get("IP")
        .filter(|s| !s.is_empty())
        .and_then(|s| s.parse().ok()))
}

/// Upstream's 90 s budget for the IPAM work, cut at the call's deadline.
pub async fn with_timeout<T>(f: impl std::future::Future<Output = T>) -> Result<T> {
    let (until, capped) = crate::support::deadline::cap_at(IPAM_TIMEOUT);
    tokio::time::timeout_at(until, f)
        .await
        .map_err(|_| match capped {
            true => {
                crate::support::deadline::expired("assigning or releasing IPAM addresses").into()
            }
            false => ContextDeadline.into(),
        })
}
