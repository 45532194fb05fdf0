//! The CNI-facing `calico-ipam` plugin (cni-plugin/pkg/ipamplugin): the entry points of a
//! separate `calico-ipam` process. Each parses its config, sets up logging and the deadline,
//! connects to the datastore and hands the work to Calico IPAM (`add`, `del`, `check`), the
//! same code the `calico` plugin runs in-process:
//! * ADD assigns addresses (AutoAssign, or AssignIP for `IP=` in CNI_ARGS) to the handle
//!   `<network>.<containerID>`;
//! * DEL releases that handle and the legacy one;
//! * CHECK verifies the handle still holds the previous result's addresses;
//! * STATUS is Calico's readiness;
//! * GC releases this node's handles of containers that are gone.
//!
//! `-upgrade` (the calico/cni image's upgrade-ipam) is `upgrade`.

pub mod add;
pub mod call;
pub mod check;
pub mod del;
pub mod kube_reads;
pub mod kubevirt;
pub mod upgrade;
pub mod vm;

use crate::call::client;
use crate::call::cluster_ready::{calico_ready, check_datastore_ready};
use crate::config::NetConf;
use crate::error::{GcError, Result};
use crate::ipam::allocator::gc::node_handles;
use crate::skel::attachments;
use crate::skel::result::prev_result;
use crate::skel::{CmdArgs, CniError, CniResult, Plugin};
use add::Supplied;

pub struct IpamPlugin;

impl Plugin for IpamPlugin {
    fn about(&self) -> String {
        format!("Calico CNI IPAM {}", crate::VERSION)
    }

    fn default_result_version(&self) -> &'static str {
        "0.1.0"
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        run(cmd_add(args))
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        run(cmd_del(args))
    }

    /// Upstream has no IPAM CHECK (success); ours verifies the handle holds the previous
    /// result's addresses.
    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        run(cmd_check(args))
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        run(async {
            let conf = load(args)?;
            calico_ready(&conf, false).await
        })
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        run(cmd_gc(args))
    }
}

/// Runs one entry point on the call's runtime; its error becomes the CNI error (once, here).
fn run<T>(call: impl std::future::Future<Output = Result<T>>) -> Result<T, CniError> {
    client::block_on(call)
        .and_then(|r| r)
        .map_err(CniError::from)
}

/// ipam_plugin.go's first steps: the config and logging (the client comes next).
fn load(args: &CmdArgs) -> Result<NetConf> {
    let conf = NetConf::parse(&args.stdin_data)?;
    crate::logging::init(&conf, "ipam");
    crate::support::deadline::configure(conf.call_timeout_seconds);
    Ok(conf)
}

async fn cmd_add(args: &CmdArgs) -> Result<CniResult> {
    let conf = load(args)?;
    let ds = client::connect(&conf).await?;
    let call = call::identify(args, conf, true)?;
    let requested = call::requested_ip(args)?;
    add::assign(&ds, &call, requested, Supplied::default()).await
}

async fn cmd_del(args: &CmdArgs) -> Result<()> {
    let conf = load(args)?;
    let ds = client::connect(&conf).await?;
    del::release(&ds, &call::identify(args, conf, false)?).await
}

/// CHECK: the handle `<network>.<containerID>` holds every address of the previous result.
async fn cmd_check(args: &CmdArgs) -> Result<()> {
    let conf = load(args)?;
    let prev = prev_result(&args.stdin_data)?;
    let ds = client::connect(&conf).await?;
    let call = call::identify(args, conf, false)?;
    check::check_with(&ds, &call.conf, &call.ids, &prev).await
}

/// GC: this node's stale handles of this network, released under the IPAM lock.
async fn cmd_gc(args: &CmdArgs) -> Result<()> {
    let valid = attachments::valid_attachments(&args.stdin_data)?;
    let conf = load(args)?;
    let ds = client::connect(&conf).await?;
    check_datastore_ready(&ds).await?;
    let node = conf.node_name();
    let handles = node_handles(&ds, &node, &conf.name).await?;
    let cids = attachments::container_ids(&valid);
    let outcome = check::gc_with(&ds, &conf, &node, &handles, &cids).await;
    if outcome.failures.is_empty() {
        return Ok(());
    }
    Err(GcError::Handles {
        network: conf.name,
        node,
        failures: outcome.failures,
    }
    .into())
}
