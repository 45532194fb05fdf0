//! What calico-ipam reads from the Kubernetes API besides Calico's own objects, through the
//! plugins' API client (`Backend::plugin_kube_client`): a namespace's labels, for pools'
//! `namespaceSelector`, and the KubeVirt VM that controls a pod. The production datastore
//! makes these reads. The memory store of the unit tests has no Kubernetes API: it answers
//! that there is nothing to read.

use std::collections::BTreeMap;

use super::kubevirt::{self, Detected, PodVmi};
use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::datastore::backend::Backend;
use crate::datastore::kubernetes::core_objects;
use crate::datastore::Datastore;
use crate::error::{Context, Result};

/// A datastore calico-ipam can also read Kubernetes objects beside (see the module).
/// Single-threaded runtime: no `Send`.
#[allow(async_fn_in_trait)]
pub trait KubeReads: Datastore {
    /// The labels of `namespace`, read when the NetConf names a kubeconfig or
    /// `policy.type: k8s` (as upstream), else none.
    async fn namespace_labels(
        &self,
        conf: &NetConf,
        namespace: &str,
    ) -> Result<BTreeMap<String, String>>;

    /// The pod's KubeVirt VM: `known` is the pod's VMI as the caller already read it
    /// (`None`: not read).
    async fn detect_vm(
        &self,
        conf: &NetConf,
        ids: &WepIdentifiers,
        known: Option<Option<PodVmi>>,
        for_del: bool,
    ) -> Result<Detected>;
}

impl KubeReads for Backend {
    async fn namespace_labels(
        &self,
        conf: &NetConf,
        namespace: &str,
    ) -> Result<BTreeMap<String, String>> {
        if (conf.kubernetes.kubeconfig.is_empty() && conf.policy.policy_type != "k8s")
            || namespace.is_empty()
        {
            return Ok(BTreeMap::new());
        }
        let fail = || format!("failed to get namespace {namespace}");
        let client = self.plugin_kube_client(conf).await.with_context(fail)?;
        let ns = core_objects::namespace(&client, namespace)
            .await
            .with_context(fail)?;
        Ok(ns.metadata.labels.unwrap_or_default())
    }

    async fn detect_vm(
        &self,
        conf: &NetConf,
        ids: &WepIdentifiers,
        known: Option<Option<PodVmi>>,
        for_del: bool,
    ) -> Result<Detected> {
        kubevirt::detect(conf, self, ids, known, for_del).await
    }
}

#[cfg(test)]
impl KubeReads for crate::datastore::memory::MemoryDatastore {
    async fn namespace_labels(
        &self,
        _conf: &NetConf,
        _namespace: &str,
    ) -> Result<BTreeMap<String, String>> {
        Ok(BTreeMap::new())
    }

    async fn detect_vm(
        &self,
        _conf: &NetConf,
        _ids: &WepIdentifiers,
        _known: Option<Option<PodVmi>>,
        _for_del: bool,
    ) -> Result<Detected> {
        Ok(Detected::NotAVm)
    }
}
