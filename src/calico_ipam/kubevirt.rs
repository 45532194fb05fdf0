//! KubeVirt VM address persistence, as v3.32.1's calico-ipam (`getVMIInfoForPod`,
//! `handleVirtLauncherPod`, libcalico-go `lib/kubevirt` and `lib/ipam/vmipam`): a VM keeps
//! its addresses across its pods (restarts, live migration) because they are held by a
//! handle named after the VM, `<network>.vmi.<namespace>.<vm>`, not after a container.
//!
//! This module finds out whether a pod runs a VM: only a pod named `virt-launcher-*` is
//! read (a pod read by the call already is not read again), and it runs one when a
//! `kubevirt.io/v1` VirtualMachineInstance controls it; then the VMI and its
//! VirtualMachine are read. The addresses' owners are kept on the allocations
//! (`ipam::owner`): the pod using them (active) and a live-migration target (alternate).

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tracing::{debug, info};

use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::datastore::backend::Backend;
use crate::datastore::kubernetes::core_objects;
use crate::datastore::DatastoreError;
use crate::error::{Error, Result, VmError};
use crate::support::encoding::base64_url_nopad;

/// KubeVirt names every VM's launcher pod so; other pods are never read for this.
pub const VIRT_LAUNCHER_PREFIX: &str = "virt-launcher-";
/// The label KubeVirt puts on a live migration's target pod (the migration's UID).
pub const MIGRATION_JOB_LABEL: &str = "kubevirt.io/migrationJobUID";
const KUBEVIRT_API: &str = "kubevirt.io/v1";
/// libcalico-go's limit on a VM handle's length (longer ones end in a hash).
const HANDLE_MAX_LEN: usize = 128;

/// The allocation attributes of a VM's address (libcalico-go `IPAMBlockAttributeVMI*`).
pub const ATTR_VMI_NAME: &str = "vmi-name";
pub const ATTR_VMI_UID: &str = "vmi-uid";
pub const ATTR_VM_UID: &str = "vm-uid";
pub const ATTR_VMIM_UID: &str = "vmim-uid";

/// What a pod says of the VMI that controls it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodVmi {
    pub vmi_name: String,
    pub vmi_uid: String,
    /// The migration's UID when the pod is a live migration's target, else empty.
    pub migration_job_uid: String,
}

/// The VMI a pod runs, `None` for a pod no `kubevirt.io/v1` VirtualMachineInstance
/// controls (upstream's `FindVMIOwnerRef`: the first such controller reference).
pub fn pod_vmi(pod: &Pod) -> Option<PodVmi> {
    let owner = pod
        .metadata
        .owner_references
        .as_deref()
        .unwrap_or_default()
        .iter()
        .find(|r| {
            r.api_version == KUBEVIRT_API
                && r.kind == "VirtualMachineInstance"
                && r.controller == Some(true)
        })?;
    let migration_job_uid = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(MIGRATION_JOB_LABEL))
        .cloned()
        .unwrap_or_default();
    Some(PodVmi {
        vmi_name: owner.name.clone(),
        vmi_uid: owner.uid.clone(),
        migration_job_uid,
    })
}

/// Whether the call's pod may run a VM, by its identifiers alone (no request).
pub fn may_be_vm_pod(ids: &WepIdentifiers) -> bool {
    ids.is_k8s() && !ids.namespace.is_empty() && ids.pod.starts_with(VIRT_LAUNCHER_PREFIX)
}

/// A VM's owning VirtualMachine.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vm {
    pub uid: String,
    pub deleting: bool,
}

/// The VMI a pod runs, and its VM.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Vmi {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub deleting: bool,
    /// `None`: a standalone VMI.
    pub vm: Option<Vm>,
    pub migration_job_uid: String,
    /// DEL only: the pod's VMI is not (or no longer) the one stored, so this pod's
    /// addresses are never released by its DEL (a newer VMI's pods may be using them).
    pub pod_outlived_vmi: bool,
}

impl Vmi {
    pub fn is_migration_target(&self) -> bool {
        !self.migration_job_uid.is_empty()
    }

    pub fn handle_id(&self, network: &str) -> String {
        vm_handle_id(network, &self.namespace, &self.name)
    }

    /// The attributes a VM's allocation carries besides node, timestamp, pod and namespace.
    pub fn attributes(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![
            (ATTR_VMI_NAME, self.name.clone()),
            (ATTR_VMI_UID, self.uid.clone()),
        ];
        if let Some(vm) = self.vm.as_ref().filter(|vm| !vm.uid.is_empty()) {
            out.push((ATTR_VM_UID, vm.uid.clone()));
        }
        if self.is_migration_target() {
            out.push((ATTR_VMIM_UID, self.migration_job_uid.clone()));
        }
        out
    }

    /// Whether the VM is going away, so its addresses may be released once no pod owns
    /// them: the VM's deletion when there is one (a VMI deleted under a live VM is a
    /// restart), else the standalone VMI's.
    pub fn going_away(&self) -> bool {
        !self.pod_outlived_vmi
            && match &self.vm {
                Some(vm) => vm.deleting,
                None => self.deleting,
            }
    }
}

/// The persistent handle of VM `name` in `namespace` (libcalico-go `CreateVMHandleID`):
/// `<network>.vmi.<namespace>.<name>`, at most 128 bytes; a longer one keeps its prefix and
/// ends in `_` and the SHA-256 of `<namespace>.<name>` in unpadded URL-safe base64, cut to
/// fit. (Upstream panics where the cut would be longer than the hash; the whole hash is
/// used there.)
pub fn vm_handle_id(network: &str, namespace: &str, name: &str) -> String {
    let network = if network.is_empty() {
        "k8s-pod-network"
    } else {
        network
    };
    let prefix = format!("{network}.vmi.");
    let suffix = format!("{namespace}.{name}");
    let total = prefix.len() + suffix.len();
    if total < HANDLE_MAX_LEN || (total == HANDLE_MAX_LEN && !suffix.starts_with('_')) {
        return prefix + &suffix;
    }
    let hash = base64_url_nopad(&Sha256::digest(suffix.as_bytes()));
    let room = HANDLE_MAX_LEN
        .saturating_sub(prefix.len() + 1)
        .min(hash.len());
    format!("{prefix}_{}", &hash[..room])
}

/// What detection found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Detected {
    NotAVm,
    /// DEL only: the pod is gone, so whether it ran a VM cannot be told.
    PodGone,
    Vm(Vmi),
}

/// The pod's VMI and VM, read when the pod may run a VM. `known`: the pod's VMI as the
/// call already read it (`Some(None)`: read, and no VMI controls it). ADD fails on any
/// read that fails (upstream's texts, under `failed to get VMI info`); DEL tolerates the
/// pod, the VMI or the VM being gone, which upstream's DEL fails on forever.
pub async fn detect(
    conf: &NetConf,
    ds: &Backend,
    ids: &WepIdentifiers,
    known: Option<Option<PodVmi>>,
    for_del: bool,
) -> Result<Detected> {
    if !may_be_vm_pod(ids) {
        return Ok(Detected::NotAVm);
    }
    read(conf, ds, ids, known, for_del)
        .await
        .map_err(|e| Error::chain("failed to get VMI info", e))
}

async fn read(
    conf: &NetConf,
    ds: &Backend,
    ids: &WepIdentifiers,
    known: Option<Option<PodVmi>>,
    for_del: bool,
) -> Result<Detected> {
    let ns = ids.namespace.as_str();
    let client = ds.plugin_kube_client(conf).await?;
    let pod_vmi = match known {
        Some(known) => known,
        None => match read_pod_vmi(&client, ids, for_del).await? {
            Some(read) => read,
            None => return Ok(Detected::PodGone),
        },
    };
    let Some(pv) = pod_vmi else {
        debug!("not a KubeVirt VM's pod");
        return Ok(Detected::NotAVm);
    };
    if pv.vmi_name.is_empty() || pv.vmi_uid.is_empty() {
        return Err(VmError::InvalidOwner {
            pod: format!("{ns}/{}", ids.pod),
            name: pv.vmi_name,
            uid: pv.vmi_uid,
        }
        .into());
    }
    let query_failed = |e: Error| {
        Error::chain(
            format!("failed to query VMI resource {ns}/{}", pv.vmi_name),
            e,
        )
    };
    let vmi_path = format!(
        "/apis/{KUBEVIRT_API}/namespaces/{ns}/virtualmachineinstances/{}",
        pv.vmi_name
    );
    let mut vmi = Vmi {
        namespace: ns.to_string(),
        name: pv.vmi_name.clone(),
        uid: pv.vmi_uid.clone(),
        migration_job_uid: pv.migration_job_uid.clone(),
        ..Default::default()
    };
    let stored = match get_kubevirt(&client, &vmi_path, for_del).await {
        Ok(Some(v)) => v,
        Ok(None) => {
            // DEL: the VMI is gone. A VM (same name) still there and not going away is
            // restarting it: its addresses stay.
            vmi.deleting = true;
            vmi.vm = read_vm(&client, ns, &pv.vmi_name, true)
                .await
                .map_err(query_failed)?;
            return Ok(Detected::Vm(vmi));
        }
        Err(e) => return Err(query_failed(e.into())),
    };
    vmi.deleting = deletion_in_progress(&stored);
    let stored_uid = stored
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if let Some(vm_name) = vm_owner(&stored) {
        vmi.vm = read_vm(&client, ns, &vm_name, for_del)
            .await
            .map_err(query_failed)?;
    }
    if stored_uid != pv.vmi_uid {
        if !for_del {
            return Err(VmError::UidMismatch {
                owner: pv.vmi_uid,
                stored: stored_uid,
            }
            .into());
        }
        // DEL of a pod whose VMI was recreated: its own ownership is still cleared.
        info!(pod_vmi_uid = %pv.vmi_uid, %stored_uid, "the pod's VMI was recreated");
        vmi.pod_outlived_vmi = true;
    }
    Ok(Detected::Vm(vmi))
}

/// The pod's VMI, read from the API: `None` when, on DEL, the pod is gone already.
async fn read_pod_vmi(
    client: &crate::datastore::kubernetes::client::KubeClient,
    ids: &WepIdentifiers,
    for_del: bool,
) -> Result<Option<Option<PodVmi>>> {
    let path = core_objects::pod_path(&ids.namespace, &ids.pod);
    match core_objects::get_if_exists::<Pod>(client, &path).await? {
        Some(pod) => Ok(Some(pod_vmi(&pod))),
        None if for_del => {
            info!("Pod already deleted, nothing to clean up for a VM");
            Ok(None)
        }
        None => Err(VmError::PodNotFound.into()),
    }
}

/// The name of the VirtualMachine that owns a stored VMI, if one does.
fn vm_owner(vmi: &Value) -> Option<String> {
    vmi.pointer("/metadata/ownerReferences")
        .and_then(Value::as_array)
        .and_then(|refs| {
            refs.iter().find(|r| {
                r.get("apiVersion").and_then(Value::as_str) == Some(KUBEVIRT_API)
                    && r.get("kind").and_then(Value::as_str) == Some("VirtualMachine")
            })
        })
        .and_then(|r| r.get("name").and_then(Value::as_str))
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// The VM `name`; on DEL a VM that is gone is `Some` VM going away.
async fn read_vm(
    client: &crate::datastore::kubernetes::client::KubeClient,
    ns: &str,
    name: &str,
    for_del: bool,
) -> Result<Option<Vm>> {
    let path = format!("/apis/{KUBEVIRT_API}/namespaces/{ns}/virtualmachines/{name}");
    Ok(Some(match get_kubevirt(client, &path, for_del).await? {
        Some(vm) => Vm {
            uid: vm
                .pointer("/metadata/uid")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            deleting: deletion_in_progress(&vm),
        },
        None => Vm {
            uid: String::new(),
            deleting: true,
        },
    }))
}

/// A KubeVirt object; a 404 is `None` when tolerated, else the API server's message.
async fn get_kubevirt(
    client: &crate::datastore::kubernetes::client::KubeClient,
    path: &str,
    tolerate_missing: bool,
) -> Result<Option<Value>, DatastoreError> {
    match tolerate_missing {
        true => core_objects::get_if_exists(client, path).await,
        false => core_objects::get(client, path).await.map(Some),
    }
}

fn deletion_in_progress(obj: &Value) -> bool {
    obj.pointer("/metadata/deletionTimestamp")
        .and_then(Value::as_str)
        .is_some_and(|t| !t.is_empty() && !t.starts_with("0001-01-01"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_ids_as_libcalico_go() {
        assert_eq!(
            vm_handle_id("", "default", "vm1"),
            "k8s-pod-network.vmi.default.vm1"
        );
        assert_eq!(
            vm_handle_id("net1", "test-ns", "test-vm"),
            "net1.vmi.test-ns.test-vm"
        );
        // Upstream's vector: network 80×n, namespace ns, VM 50×v.
        let net = "n".repeat(80);
        let h = vm_handle_id(&net, "ns", &"v".repeat(50));
        assert_eq!(
            h,
            format!("{net}.vmi._AAy5aHZCBKq47PUuKFsQH-N3EmscwtzjmpLSKbt5mC")
        );
        assert_eq!(h.len(), 128);
        // Where upstream panics (the default network, a long name): the whole hash.
        let h = vm_handle_id("k8s-pod-network", "ns", &"v".repeat(120));
        assert!(h.starts_with("k8s-pod-network.vmi._"), "{h}");
        assert_eq!(h.len(), "k8s-pod-network.vmi._".len() + 43);
    }

    #[test]
    fn pods_and_vmis() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "virt-launcher-vm1-abcde", "namespace": "ns",
                "labels": {MIGRATION_JOB_LABEL: "m-1"},
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Other", "name": "x", "uid": "u0", "controller": true},
                    {"apiVersion": KUBEVIRT_API, "kind": "VirtualMachineInstance",
                     "name": "vm1", "uid": "u1", "controller": true}]}
        }))
        .unwrap();
        let pv = pod_vmi(&pod).unwrap();
        assert_eq!((pv.vmi_name.as_str(), pv.vmi_uid.as_str()), ("vm1", "u1"));
        assert_eq!(pv.migration_job_uid, "m-1");
        let not_controller: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"ownerReferences": [{"apiVersion": KUBEVIRT_API,
                "kind": "VirtualMachineInstance", "name": "vm1", "uid": "u1"}]}
        }))
        .unwrap();
        assert_eq!(pod_vmi(&not_controller), None);

        let vmi = Vmi {
            name: "vm1".into(),
            uid: "u1".into(),
            vm: Some(Vm {
                uid: "u2".into(),
                deleting: false,
            }),
            deleting: true,
            ..Default::default()
        };
        // A VMI deleted under a live VM is a restart.
        assert!(!vmi.going_away());
        let attrs: Vec<_> = vmi.attributes().into_iter().map(|(k, _)| k).collect();
        assert_eq!(attrs, [ATTR_VMI_NAME, ATTR_VMI_UID, ATTR_VM_UID]);
        let standalone = Vmi {
            vm: None,
            ..vmi.clone()
        };
        assert!(standalone.going_away());
        assert!(!Vmi {
            pod_outlived_vmi: true,
            ..standalone
        }
        .going_away());
    }
}
