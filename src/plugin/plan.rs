//! The plan of one `calico` call, computed once from the NetConf, the CNI arguments, the
//! identifiers and the datastore: which IPAM and where it runs, the orchestrator, the policy
//! mode, the address families IPAM will return, the deadline, and which of ADD's steps start
//! early or go together (`AddSteps`). ADD, DEL, CHECK and GC read it instead of re-deriving
//! each answer from strings at every step.

use std::net::IpAddr;
use std::time::Instant;

use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::dataplane::Families;
use crate::plugin::ipam::{self, IpamKind};
use crate::skel::CmdArgs;

#[derive(Clone, Debug)]
pub struct Plan {
    /// The IPAM the NetConf names.
    pub ipam: IpamKind,
    /// Calico IPAM runs in this process (`ipam::pick`).
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
    /// What ADD starts early and what goes together.
    pub add: AddSteps,
    /// When the call must be done (`crate::support::deadline`; `None` when not armed).
    pub deadline: Option<Instant>,
}

/// ADD's decisions about its own order, made once: what joins the first round trip, and
/// where a new endpoint is written. Every other step runs where it stands in `add`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AddSteps {
    /// The IPAM reads its view (Calico IPAM in-process: AutoAssign's reads, under the host's
    /// IPAM lock) in the first round trip: a Kubernetes pod without readiness gates (the
    /// lock would be held while they wait).
    pub ipam_view_in_first_round_trip: bool,
    /// How a new endpoint is written.
    pub new_endpoint: EndpointWrite,
}

/// Where a new WorkloadEndpoint is written, relative to the other steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointWrite {
    /// With Calico IPAM's block write (the allocator's `WriteBeside`): on the Kubernetes
    /// datastore a pod's endpoint is its address annotations, all known once the addresses
    /// are. Only for a pod no ADD has networked yet.
    WithAddresses,
    /// While the interface is finished, when its MAC is known before (the Linux pair built
    /// for the addresses' families: etcd's endpoint stores the MAC); else after it.
    WithInterface,
}

impl Plan {
    /// `families`: `expected_families`, worked out once by the caller.
    pub fn new(
        conf: &NetConf,
        args: &CmdArgs,
        ids: &WepIdentifiers,
        kdd: bool,
        families: Option<Families>,
    ) -> Plan {
        let ipam = IpamKind::of(&conf.ipam.ipam_type);
        let k8s = ids.is_k8s();
        let policy_k8s = k8s && conf.policy.policy_type == "k8s";
        let ipam_in_process = ipam::runs_in_process(ipam, &conf.ipam.ipam_type, &args.path);
        let no_gates = conf.readiness_gates.is_empty();
        let new_endpoint = match k8s && kdd && ipam == IpamKind::Calico && ipam_in_process {
            true => EndpointWrite::WithAddresses,
            false => EndpointWrite::WithInterface,
        };
        Plan {
            ipam,
            ipam_in_process,
            k8s,
            policy_k8s,
            endpoint_from_pod: policy_k8s && kdd,
            want_profile: conf.policy.policy_type.is_empty(),
            families,
            add: AddSteps {
                ipam_view_in_first_round_trip: k8s && no_gates && ipam_in_process,
                new_endpoint,
            },
            deadline: crate::support::deadline::limit(),
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

#[cfg(test)]
mod tests {
    use super::*;

    const K8S_ARGS: &str = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns1;K8S_POD_NAME=pod1";

    /// ADD's decisions for each kind of configuration: what joins the first round trip,
    /// where a new endpoint goes, and where the endpoint comes from.
    #[test]
    fn add_steps_for_each_configuration() {
        // A CNI_PATH whose calico-ipam is this very executable (Calico IPAM in-process).
        let dir = std::env::temp_dir().join(format!("plan-table-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let link = dir.join("calico-ipam");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/proc/self/exe", &link).unwrap();
        let in_process = dir.display().to_string();

        // (name, k8s, kdd, extra NetConf keys, CNI_PATH) → (IPAM view in the first round trip, new
        // endpoint, endpoint from the pod, pod read)
        use EndpointWrite::{WithAddresses, WithInterface};
        let cases = [
            (
                "kdd, policy k8s, calico-ipam in-process",
                true,
                true,
                r#","policy":{"type":"k8s"}"#,
                in_process.as_str(),
                (true, WithAddresses, true, true),
            ),
            (
                "kdd, no policy",
                true,
                true,
                "",
                in_process.as_str(),
                (true, WithAddresses, false, false),
            ),
            (
                "kdd, calico-ipam executed",
                true,
                true,
                "",
                "/nonexistent",
                (false, WithInterface, false, false),
            ),
            (
                "etcd, policy k8s",
                true,
                false,
                r#","policy":{"type":"k8s"}"#,
                in_process.as_str(),
                (true, WithInterface, false, true),
            ),
            (
                "etcd, no policy",
                true,
                false,
                "",
                in_process.as_str(),
                (true, WithInterface, false, false),
            ),
            (
                "etcd, readiness gate",
                true,
                false,
                r#","readiness_gates":["http://127.0.0.1:1/"]"#,
                in_process.as_str(),
                (false, WithInterface, false, false),
            ),
            (
                "kdd, readiness gate",
                true,
                true,
                r#","readiness_gates":["http://127.0.0.1:1/"]"#,
                in_process.as_str(),
                (false, WithAddresses, false, false),
            ),
            (
                "etcd, bad dataplane options",
                true,
                false,
                r#","dataplane_options":{"type":"nope"}"#,
                in_process.as_str(),
                (true, WithInterface, false, false),
            ),
            (
                "etcd, host-local",
                true,
                false,
                r#","ipam":{"type":"host-local"}"#,
                in_process.as_str(),
                (false, WithInterface, false, false),
            ),
            (
                "kdd, host-local",
                true,
                true,
                r#","ipam":{"type":"host-local"}"#,
                in_process.as_str(),
                (false, WithInterface, false, false),
            ),
            (
                "plain CNI, etcd",
                false,
                false,
                "",
                in_process.as_str(),
                (false, WithInterface, false, false),
            ),
            (
                "plain CNI, kdd",
                false,
                true,
                r#","policy":{"type":"k8s"}"#,
                in_process.as_str(),
                (false, WithInterface, false, false),
            ),
        ];
        for (name, k8s, kdd, extra, path, want) in cases {
            let ipam = if extra.contains("\"ipam\"") {
                ""
            } else {
                r#","ipam":{"type":"calico-ipam"}"#
            };
            let stdin = format!(r#"{{"name":"net1","type":"calico"{ipam}{extra}}}"#);
            let conf = NetConf::parse(stdin.as_bytes()).unwrap();
            let cni_args = if k8s { K8S_ARGS } else { "" };
            let ids = WepIdentifiers::from_cni_args("node1", "c1", "eth0", cni_args).unwrap();
            let args = CmdArgs {
                path: path.to_string(),
                args: cni_args.to_string(),
                ..Default::default()
            };
            let families = expected_families(IpamKind::of(&conf.ipam.ipam_type), &conf, &args);
            let plan = Plan::new(&conf, &args, &ids, kdd, families);
            let got = (
                plan.add.ipam_view_in_first_round_trip,
                plan.add.new_endpoint,
                plan.endpoint_from_pod,
                plan.policy_k8s,
            );
            assert_eq!(got, want, "{name}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
