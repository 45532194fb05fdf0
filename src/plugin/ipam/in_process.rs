//! Calico IPAM in the `calico` process (`InProcess`): the calico-ipam verbs
//! (`crate::calico_ipam`) on the datastore connection the call already has, with what the
//! call has already parsed.

use std::collections::BTreeSet;

use tracing::debug;

use crate::calico_ipam::add::{assign, Prepared};
use crate::calico_ipam::call::{call_for, ipam_args, requested_ip, Known};
use crate::calico_ipam::check::{check_with, gc_with};
use crate::calico_ipam::del::release;
use crate::datastore::Datastore;
use crate::error::Result;
use crate::ipam::allocator::gc::{GcOutcome, NodeHandles};
use crate::skel::{CmdArgs, CniResult};

/// Calico IPAM in the `calico` process, on the call's datastore, with what the call has
/// already parsed (`known`, valid for the stdin it was parsed from: `stdin`).
pub struct InProcess<'a, D> {
    pub ds: &'a D,
    pub known: Known<'a>,
    pub stdin: &'a [u8],
}

impl<D: Datastore> InProcess<'_, D> {
    /// What the call knows of `args`, when `args` carries the very stdin it was parsed from
    /// (ADD rewrites the IPAM's stdin for some pod annotations: that one is parsed anew).
    fn known_for(&self, args: &CmdArgs) -> Option<Known<'_>> {
        (args.stdin_data == self.stdin).then_some(self.known)
    }

    pub async fn add(&self, args: &CmdArgs, prepared: Prepared<'_>) -> Result<CniResult> {
        debug!("running calico-ipam ADD in-process");
        let args = ipam_args(args);
        let call = call_for(&args, self.known_for(&args), true)?;
        assign(self.ds, &call, requested_ip(&args)?, prepared).await
    }

    pub async fn del(&self, args: &CmdArgs) -> Result<()> {
        debug!("running calico-ipam DEL in-process");
        let args = ipam_args(args);
        release(self.ds, &call_for(&args, self.known_for(&args), false)?).await
    }

    pub async fn check(&self, prev: &CniResult) -> Result<()> {
        check_with(self.ds, self.known.conf, self.known.ids, prev).await
    }

    pub async fn gc(
        &self,
        node: &str,
        handles: &NodeHandles,
        valid: &BTreeSet<String>,
    ) -> GcOutcome {
        gc_with(self.ds, self.known.conf, node, handles, valid).await
    }
}
