//! The plan of one `calico` call, computed once from the NetConf, the CNI arguments, the
//! identifiers and the datastore: which IPAM and where it runs, the orchestrator, the policy
//! mode, the address families IPAM will return, the deadline. ADD, DEL, CHECK and GC read
//! it instead of re-deriving each answer from strings at every step.

use std::net::IpAddr;
use std::time::Instant;

use crate::config::NetConf;
use crate::dataplane::Families;
use crate::identifiers::WepIdentifiers;
use crate::ipam_driver::{self, IpamKind};
use crate::skel::CmdArgs;

#[derive(Clone, Debug)]
pub struct Plan {
    /// The IPAM the NetConf names.
    pub ipam: IpamKind,
    /// Calico IPAM runs in this process (`ipam_driver::pick`).
    pub ipam_in_process: bool,
    /// The orchestrator is Kubernetes (`K8S_POD_NAME` and friends in CNI_ARGS).
    pub k8s: bool,
    /// Kubernetes with `policy.type: k8s`: the pod and its namespace are read.
    pub policy_k8s: bool,
    /// On the Kubernetes datastore with `policy.type: k8s` the endpoint is the pod itself,
    /// read once with it.
    pub endpoint_from_pod: bool,
    /// No policy type: the network's Profile is ensured.
    pub want_profile: bool,
    /// The families Calico IPAM's answer will have, as the configuration tells them
    /// (`None` for other IPAM plugins, or when annotations may change them).
    pub families: Option<Families>,
    /// When the call must be done (`crate::deadline`; `None` when not armed).
    pub deadline: Option<Instant>,
}

impl Plan {
    pub fn new(conf: &NetConf, args: &CmdArgs, ids: &WepIdentifiers, kdd: bool) -> Plan {
        let ipam = IpamKind::of(&conf.ipam.ipam_type);
        let k8s = ids.is_k8s();
        let policy_k8s = k8s && conf.policy.policy_type == "k8s";
        Plan {
            ipam,
            ipam_in_process: ipam_driver::runs_in_process(ipam, &conf.ipam.ipam_type, &args.path),
            k8s,
            policy_k8s,
            endpoint_from_pod: policy_k8s && kdd,
            want_profile: conf.policy.policy_type.is_empty(),
            families: expected_families(ipam, conf, args),
            deadline: crate::deadline::limit(),
        }
    }
}

/// The families calico-ipam's answer will have, as the configuration tells them: the
/// family of `IP=` in CNI_ARGS, else `assign_ipv4`/`assign_ipv6` (calico-ipam fails rather
/// than return fewer). `None` for other IPAM plugins.
pub fn expected_families(ipam: IpamKind, conf: &NetConf, args: &CmdArgs) -> Option<Families> {
    if ipam != IpamKind::Calico {
        return None;
    }
    let requested = args
        .args
        .split(';')
        .find_map(|kv| kv.strip_prefix("IP="))
        .filter(|v| !v.is_empty());
    match requested {
        Some(ip) => ip.parse::<IpAddr>().ok().map(|ip| families_of(&[ip])),
        None => Some(Families {
            v4: conf.assign_ipv4(),
            v6: conf.assign_ipv6(),
        }),
    }
}

pub fn families_of(ips: &[IpAddr]) -> Families {
    Families {
        v4: ips.iter().any(IpAddr::is_ipv4),
        v6: ips.iter().any(IpAddr::is_ipv6),
    }
}
