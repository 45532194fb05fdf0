//! Calico IPAM in the `calico` process (`InProcess`): the calico-ipam verbs
//! (`crate::calico_ipam`) on the datastore connection the call already has, with what the
//! call has already parsed.

use std::collections::BTreeSet;

use tracing::debug;

use super::AddHints;
use crate::calico_ipam::add::{assign, LockedView, Supplied};
use crate::calico_ipam::call::{call_for, ipam_args, requested_ip, Known};
use crate::calico_ipam::check::{check_with, gc_with};
use crate::calico_ipam::del::release;
use crate::calico_ipam::kube_reads::KubeReads;
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

impl<D: KubeReads> InProcess<'_, D> {
    /// What the call knows of `args`, when `args` carries the very stdin it was parsed from
    /// (ADD rewrites the IPAM's stdin for some pod annotations: that one is parsed anew).
    fn known_for(&self, args: &CmdArgs) -> Option<Known<'_>> {
        (args.stdin_data == self.stdin).then_some(self.known)
    }

    /// calico-ipam's ADD on `view`, with the pod's VMI and its namespace's labels as the
    /// call read them (`hints.pod`), else read as a separate calico-ipam would.
    pub async fn add(
        &self,
        args: &CmdArgs,
        view: LockedView,
        hints: AddHints<'_>,
    ) -> Result<CniResult> {
        debug!("running calico-ipam ADD in-process");
        let args = ipam_args(args);
        let call = call_for(&args, self.known_for(&args), true)?;
        let supplied = Supplied {
            pod_vmi: hints.pod.and_then(|p| p.kubevirt.clone()),
            namespace_labels: hints.pod.map(|p| p.namespace_labels.clone()),
            view,
            beside: hints.beside,
        };
        assign(self.ds, &call, requested_ip(&args)?, supplied).await
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
