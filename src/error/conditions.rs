//! Conditions the programs find in what they are given or what they read, with no cause
//! below them: one enum per subject, each variant holding what the text names. The texts
//! are upstream's (k8s.go, kubevirt.go, the CHECK of utils.go), so a result reads the same.

use serde_json::Value;

/// A pod's Calico annotations (or the IPAM settings they override) that cannot be honoured.
#[derive(Debug, thiserror::Error)]
pub enum AnnotationError {
    /// The IPAM stdin a pool or family annotation rewrites has no `ipam` object.
    #[error("data on stdin was of unexpected type")]
    IpamStdinNotAnObject,
    #[error("error parsing ipFamilies: {0}")]
    IpFamilies(String),
    #[error("can't have both annotations: 'ipAddrs' and 'ipAddrsNoIpam' in use at the same time")]
    BothAddressAnnotations,
    /// `ipAddrs` / `ipAddrsNoIpam` with an IPAM plugin other than calico-ipam.
    #[error("{annotation} is not compatible with configured IPAM: {ipam_type}")]
    IpamNotCalico {
        annotation: &'static str,
        ipam_type: String,
    },
    /// A `featureControl` switch that is off.
    #[error("requested feature is not enabled: {0}")]
    FeatureDisabled(&'static str),
    /// A feature only the Kubernetes orchestrator has.
    #[error("requested feature is not supported for this runtime: {0}")]
    FeatureUnsupported(&'static str),
    /// `hwAddr` that Go's `net.ParseMAC` refuses (its text names the address unless empty).
    #[error(
        "failed to parse MAC address {raw} provided via {annotation}: {}invalid MAC address",
        if raw.is_empty() { String::new() } else { format!("address {raw}: ") }
    )]
    InvalidMac {
        raw: String,
        annotation: &'static str,
    },
    /// `hwAddr` that parses but is not an Ethernet (6-octet) address: the kernel's refusal.
    #[error(
        "failed to set container veth MAC to {raw} as requested via {annotation}: invalid argument"
    )]
    MacNotEthernet {
        raw: String,
        annotation: &'static str,
    },
    #[error("annotation \"{0}\" specified but empty")]
    NoAddresses(&'static str),
    #[error("cannot have more than one IPv{family} address for \"{annotation}\" annotation")]
    TwoAddressesOfFamily {
        family: u8,
        annotation: &'static str,
    },
}

/// host-local's settings as the Kubernetes orchestrator completes them: the node's pod
/// CIDRs (`usePodCidr`) and the `ipam.routes` section.
#[derive(Debug, thiserror::Error)]
pub enum HostLocalError {
    #[error("no podCidr for node {0}")]
    NoPodCidr(String),
    #[error("ClusterCIDR contains two ranges of the same type")]
    PodCidrsOfOneFamily,
    #[error("failed to parse host-local IPAM routes section; expecting list, not: {0}")]
    RoutesNotAList(Value),
    #[error("invalid IPAM routes section; expecting a route object, not: {0}")]
    RouteNotAnObject(Value),
    #[error("invalid IPAM routes section; expecting 'dst' to be a string, not: {0}")]
    RouteDstNotAString(Value),
}

/// An IPAM plugin's answer to ADD that holds no address.
#[derive(Debug, thiserror::Error)]
pub enum EmptyIpamAnswer {
    /// The Kubernetes orchestrator's wording.
    #[error("IPAM plugin returned missing IP config")]
    MissingIpConfig,
    /// Any other orchestrator's.
    #[error("IPAM plugin returned no IP addresses in result")]
    NoAddresses,
}

/// What CHECK finds that differs from the previous result; `endpoint` is
/// `<namespace>/<WorkloadEndpoint name>`.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("CHECK: the previous result has no IP addresses")]
    ResultWithoutAddresses,
    #[error("CHECK: WorkloadEndpoint {endpoint} does not exist")]
    NoEndpoint { endpoint: String },
    #[error("CHECK: WorkloadEndpoint {endpoint} belongs to container {container}")]
    OtherContainer { endpoint: String, container: String },
    /// The addresses, each list sorted and joined with spaces.
    #[error(
        "CHECK: WorkloadEndpoint {endpoint} has addresses [{stored}], the result says [{result}]"
    )]
    Addresses {
        endpoint: String,
        stored: String,
        result: String,
    },
    #[error(
        "CHECK: WorkloadEndpoint {endpoint} names interface {stored}, the result says {result}"
    )]
    Interface {
        endpoint: String,
        stored: String,
        result: String,
    },
    #[error("CHECK: WorkloadEndpoint {endpoint} has MAC {stored}, the result says {result}")]
    Mac {
        endpoint: String,
        stored: String,
        result: String,
    },
}

/// A KubeVirt VM's pod whose VMI or addresses do not allow the call.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// `pod` is `<namespace>/<name>`.
    #[error("pod {pod} has invalid VMI ownerReference: name={name:?} uid={uid:?}")]
    InvalidOwner {
        pod: String,
        name: String,
        uid: String,
    },
    #[error("VMI UID mismatch: pod ownerReference has {owner} but VMI resource has {stored}")]
    UidMismatch { owner: String, stored: String },
    /// ADD's pod is not in the API.
    #[error("pod not found")]
    PodNotFound,
    #[error(
        "live migration target pod is not allowed when KubeVirtVMAddressPersistence is disabled"
    )]
    MigrationWithoutPersistence,
    #[error("migration target pod but no IP allocated to VM handle {0}")]
    MigrationWithoutAddresses(String),
}

/// A calico-ipam request its pools cannot satisfy.
#[derive(Debug, thiserror::Error)]
pub enum PoolRequestError {
    /// Fewer addresses than asked for; `reason` is the allocator's account of it.
    #[error("failed to request IPv{version} addresses: {reason}")]
    Shortfall { version: u8, reason: String },
    /// A pool named neither by a CIDR nor by an IPPool's name.
    #[error("error parsing pool \"{0}\": invalid CIDR address: {0}")]
    UnknownPool(String),
    #[error("\"{addr}\" isn't a IPv{version} address")]
    WrongFamily { addr: std::net::IpAddr, version: u8 },
}

/// A readiness gate (`policy.readiness_gates`) that ADD cannot pass.
#[derive(Debug, thiserror::Error)]
pub enum ReadinessGateError {
    #[error("invalid URL set for ReadinessGates:{gate} Error:{reason}")]
    InvalidUrl { gate: String, reason: String },
    #[error("readiness gate {gate} was not ready within {}s: context deadline exceeded", .within.as_secs())]
    NotReady {
        gate: String,
        within: std::time::Duration,
    },
}

/// ClusterInformation `default` does not say `datastoreReady: true` (an upgrade, say).
#[derive(Debug, thiserror::Error)]
#[error("Calico is currently not ready to process requests")]
pub struct DatastoreNotReady;

/// One of upstream's own time limits ran out (a Go context's timeout, Go's text): not the
/// call's deadline, so not "try again later".
#[derive(Debug, thiserror::Error)]
#[error("context deadline exceeded")]
pub struct ContextDeadline;

/// GC's failures: every step runs, and all that failed are reported together, joined with
/// "; ". calico counts its steps, calico-ipam the handles it could not release.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("GC of network {network} on node {node} failed in {} step(s): {}", .failures.len(), super::join(.failures))]
    Steps {
        network: String,
        node: String,
        failures: Vec<super::Error>,
    },
    #[error("GC of network {network} on node {node} failed for {} handle(s): {}", .failures.len(), super::join(.failures))]
    Handles {
        network: String,
        node: String,
        failures: Vec<crate::ipam::allocator::gc::HandleNotReleased>,
    },
    /// The in-process IPAM's step when listing the node's blocks failed.
    #[error("IPAM addresses were not collected")]
    AddressesNotCollected,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_upstreams() {
        let hw = "cni.projectcalico.org/hwAddr";
        let mac = |raw: &str| AnnotationError::InvalidMac {
            raw: raw.into(),
            annotation: hw,
        };
        assert_eq!(
            mac("").to_string(),
            "failed to parse MAC address  provided via cni.projectcalico.org/hwAddr: invalid MAC address"
        );
        assert_eq!(
            mac("zz").to_string(),
            "failed to parse MAC address zz provided via cni.projectcalico.org/hwAddr: address zz: invalid MAC address"
        );
        let routes = HostLocalError::RoutesNotAList(serde_json::json!({"dst": "0.0.0.0/0"}));
        assert_eq!(
            routes.to_string(),
            r#"failed to parse host-local IPAM routes section; expecting list, not: {"dst":"0.0.0.0/0"}"#
        );
        let owner = VmError::InvalidOwner {
            pod: "ns/virt-launcher".into(),
            name: "vm1".into(),
            uid: String::new(),
        };
        assert_eq!(
            owner.to_string(),
            r#"pod ns/virt-launcher has invalid VMI ownerReference: name="vm1" uid="""#
        );
    }

    #[test]
    fn gc_reports_every_failure_in_one_text_each_kept_typed() {
        use crate::datastore::DatastoreError;
        use crate::ipam::allocator::gc::HandleNotReleased;
        use crate::ipam::allocator::IpamError;
        let gone = || DatastoreError::Conflict("WorkloadEndpoint(ns/w)".into());
        let steps = GcError::Steps {
            network: "k8s-pod-network".into(),
            node: "n1".into(),
            failures: vec![
                super::super::Error::chain("WorkloadEndpoint ns/w", gone()),
                GcError::AddressesNotCollected.into(),
            ],
        };
        assert_eq!(
            steps.to_string(),
            "GC of network k8s-pod-network on node n1 failed in 2 step(s): WorkloadEndpoint \
             ns/w: update conflict: WorkloadEndpoint(ns/w); IPAM addresses were not collected"
        );
        let GcError::Steps { failures, .. } = &steps else {
            unreachable!()
        };
        assert!(matches!(
            &failures[0],
            super::super::Error::Chain { source, .. }
                if matches!(**source, super::super::Error::Datastore(DatastoreError::Conflict(_)))
        ));
        let handles = GcError::Handles {
            network: "net".into(),
            node: "n1".into(),
            failures: vec![HandleNotReleased {
                handle: "net.c1".into(),
                source: IpamError::Datastore(gone()),
            }],
        };
        assert_eq!(
            handles.to_string(),
            "GC of network net on node n1 failed for 1 handle(s): net.c1: update conflict: \
             WorkloadEndpoint(ns/w)"
        );
    }
}
