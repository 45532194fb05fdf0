//! CNI 1.1 STATUS for `calico` and `calico-ipam`: is Calico ready to serve ADD? One bounded
//! read of ClusterInformation `default` (the same gate ADD passes), plus the nodename file
//! ADD needs. Failures are code 50 ("not available"): existing pods keep their connectivity
//! (Felix programs them), so 51 never applies. containerd polls STATUS every few seconds
//! through the CRI, so it stays one request with a short bound and never writes.

use std::time::Duration;

use crate::client;
use crate::config::NetConf;
use crate::error::Error;
use crate::plugin::{check_datastore_ready, ipam_exec};
use crate::skel::error::CODE_NOT_AVAILABLE;
use crate::skel::{CmdArgs, CniError};

/// The bound on the whole check, connection included.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(2);

/// `calico` STATUS: ready itself, then its IPAM plugin's STATUS (the spec's delegation). An
/// in-process calico-ipam would repeat the very same read, so it is not asked again.
pub async fn cmd_status(args: &CmdArgs) -> Result<(), CniError> {
    let conf = NetConf::parse(&args.stdin_data).map_err(|e| CniError::from(Error::from(e)))?;
    crate::logging::init(&conf, "cni-plugin");
    calico_ready(&conf, true).await?;
    let ipam = conf.ipam.ipam_type.as_str();
    if ipam.is_empty() || ipam_exec::is_own_ipam(ipam, &args.path) {
        return Ok(());
    }
    ipam_exec::exec_verb(ipam, "STATUS", args).map_err(CniError::from)
}

/// Calico's readiness for ADD, as a code-50 error when not ready. `calico` also needs the
/// nodename file calico/node writes (its ADD fails without it); calico-ipam does not.
pub async fn calico_ready(conf: &NetConf, needs_nodename_file: bool) -> Result<(), CniError> {
    if needs_nodename_file {
        conf.check_nodename_file()
            .map_err(|e| not_available("the node is not ready", Error::from(e)))?;
    }
    let read = async {
        let ds = client::connect(conf).await?;
        check_datastore_ready(&ds).await
    };
    match tokio::time::timeout(STATUS_TIMEOUT, read).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(not_available("the Calico datastore is not ready", e)),
        Err(_) => Err(CniError::new(
            CODE_NOT_AVAILABLE,
            format!(
                "the Calico datastore did not answer within {}s",
                STATUS_TIMEOUT.as_secs()
            ),
            "",
        )),
    }
}

fn not_available(what: &str, cause: Error) -> CniError {
    CniError::new(CODE_NOT_AVAILABLE, format!("{what}: {cause}"), "")
}
