//! CNI 1.1 STATUS for `calico` and `calico-ipam`: is Calico ready to serve ADD? One bounded
//! read of ClusterInformation `default` (the same gate ADD passes), plus the nodename file
//! ADD needs. Failures are code 50 ("not available"): existing pods keep their connectivity
//! (Felix programs them), so 51 never applies. containerd polls STATUS every few seconds
//! through the CRI, so it stays one request with a short bound and never writes.

use crate::call::cluster_ready::calico_ready;
use crate::config::NetConf;
use crate::delegate::exec::Exec;
use crate::error::Error;
use crate::plugin::ipam::{self, IpamKind};
use crate::skel::{CmdArgs, CniError};

/// `calico` STATUS: ready itself, then its IPAM plugin's STATUS (the spec's delegation). An
/// in-process calico-ipam would repeat the very same read, so it is not asked again.
pub async fn cmd_status(args: &CmdArgs) -> Result<(), CniError> {
    let conf = NetConf::parse(&args.stdin_data).map_err(|e| CniError::from(Error::from(e)))?;
    crate::logging::init(&conf, "cni-plugin");
    calico_ready(&conf, true).await.map_err(CniError::from)?;
    // STATUS opens no datastore connection beyond the readiness read, so the driver's
    // choice is made here without one: in-process, there is nothing more to ask.
    let ipam = conf.ipam.ipam_type.as_str();
    let kind = IpamKind::of(ipam);
    if kind == IpamKind::None || ipam::runs_in_process(kind, ipam, &args.path) {
        return Ok(());
    }
    Exec::new(ipam)
        .verb("STATUS", args)
        .await
        .map_err(|e| CniError::from(Error::from(e)))
}
