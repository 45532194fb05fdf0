//! ADD for a Kubernetes pod (k8s.go CmdAddK8s): the endpoint from the pod (labels, ports,
//! service account, annotations), the addresses from where the pod says
//! (`k8s_pod::AddressSource`), the pod's routes, and the wait for Felix's policy.

use std::net::IpAddr;

use serde_json::Value;
use tracing::info;

use super::commit::{addresses_and_interface, addresses_of, finish_and_write, Finish};
use super::{
    endpoint_name, ipam_add, validate_endpoint_and_profile, veth_request, AddCx, CheckedReads,
    IpamView, Record,
};
use crate::calico_ipam::del::release_any;
use crate::dataplane::{Families, VethRequest};
use crate::datastore::model::WorkloadEndpoint;
use crate::delegate::exec::{host_local_add_stdin, uses_pod_cidr};
use crate::delegate::DelegateError;
use crate::error::{Context, EmptyIpamAnswer, Error, HostLocalError, Result};
use crate::plugin::endpoint;
use crate::plugin::endpoint_status;
use crate::plugin::ipam::{AddHints, IpamDriver, IpamKind, WriteBeside};
use crate::plugin::k8s_pod::{self, AddressSource, PodInfo};
use crate::plugin::plan::{families_of, EndpointWrite};
use crate::plugin::Call;
use crate::skel::result::IpConfig;
use crate::skel::{CmdArgs, CniResult};
use crate::support::net::IpNet;

pub async fn add(cx: &AddCx<'_>, made: &Record<'_>, answered: CheckedReads) -> Result<CniResult> {
    let call = cx.call;
    let (conf, ids, plan) = (&call.conf, &call.ids, &call.plan);
    let CheckedReads {
        existing,
        profile,
        pod,
        ipam: ipam_view,
    } = answered;
    // Upstream makes its API client first thing (k8s.go NewK8sClient), whatever the policy
    // type: with nothing to make it from (no kubeconfig, API root or in-cluster
    // environment) or a kubeconfig it cannot load, the ADD fails before anything is done.
    call.ds.plugin_kube_client(conf).await?;
    // Upstream refuses a negative delay only after writing the endpoint (and leaks the IP).
    endpoint_status::validate_timeout(conf.policy_setup_timeout_seconds)?;
    let routes = k8s_routes(conf)?;
    let name = endpoint_name(call, existing.as_ref())?;
    let old_addresses: Vec<String> = existing
        .as_ref()
        .map(|w| w.spec.ip_networks.clone())
        .unwrap_or_default();
    let pod = pod.unwrap_or_default();
    // Every annotation is checked before IPAM (upstream checks some after networking and
    // leaks the addresses when they are wrong).
    let wep = pod_endpoint(call, existing, &name, &pod)?;
    let floating_ips = pod.floating_ips(conf)?;
    let container_mac = pod.hw_addr()?;
    let source = pod.address_source(conf)?;
    let args = ipam_args_of(cx).await?;
    validate_endpoint_and_profile(&wep, profile.as_ref())?;

    // A pod no ADD has networked yet gets its endpoint with Calico IPAM's block write where
    // the plan says so (the Kubernetes datastore): one round trip less.
    let endpoint_write = match plan.add.new_endpoint {
        EndpointWrite::WithAddresses if old_addresses.is_empty() => {
            made.endpoint().plan(&wep);
            EndpointWrite::WithAddresses
        }
        _ => EndpointWrite::WithInterface,
    };
    let request = AddressRequestOf {
        cx,
        made,
        args: &args,
        pod: &pod,
        pod_read: plan.policy_k8s.then_some(&pod),
        host_veth: &wep.spec.interface_name,
        container_mac,
        beside: (endpoint_write == EndpointWrite::WithAddresses)
            .then(|| made.endpoint() as &dyn WriteBeside),
    };
    let result = request.addresses(source, ipam_view, &old_addresses).await?;
    let finish = Finish {
        args: &args,
        routes,
        mtu: cx.result_mtu,
        allow_ip_forwarding: conf.container_settings.allow_ip_forwarding,
        endpoint_write,
        floating_ips,
        skip_host_routes: skips_host_routes(call, &result),
        annotations: pod.annotations.clone(),
    };
    let result = finish_and_write(made, result, wep, finish).await?;
    endpoint_status::wait_for_policy(
        &conf.endpoint_status_dir,
        &ids.namespace,
        &name,
        conf.policy_setup_timeout_seconds,
    )
    .await;
    Ok(result)
}

/// The pod's endpoint as it will be written, but for what IPAM and the interface add: the
/// existing one's or a new one, with (policy type k8s) the pod's labels, generateName,
/// ports, profiles and service account, and its allowed source prefixes.
fn pod_endpoint(
    call: &Call,
    existing: Option<WorkloadEndpoint>,
    name: &str,
    pod: &PodInfo,
) -> Result<WorkloadEndpoint> {
    let mut wep = k8s_endpoint(call, existing, name);
    if call.plan.policy_k8s {
        wep.metadata.labels = Some(pod.labels.clone());
        wep.metadata.generate_name = pod.generate_name.clone();
        wep.spec.ports = pod.ports.clone();
        wep.spec.profiles = pod.profiles.clone();
        wep.spec.service_account_name = pod.service_account.clone();
    }
    wep.spec.allow_spoofed_source_prefixes = pod.source_prefixes()?;
    Ok(wep)
}

/// The arguments the IPAM plugin is run with: the call's, with host-local's `usePodCidr`
/// replaced by the node's pod CIDRs.
async fn ipam_args_of(cx: &AddCx<'_>) -> Result<CmdArgs> {
    let (call, mut args) = (cx.call, cx.args.clone());
    if call.plan.ipam == IpamKind::HostLocal && uses_pod_cidr(&args.stdin_data) {
        let (v4, v6) = k8s_pod::node_pod_cidrs(call).await?;
        args.stdin_data =
            host_local_add_stdin(&args.stdin_data, &v4, &v6).map_err(DelegateError::from)?;
    }
    Ok(args)
}

/// A calico-ipam result without routes is a KubeVirt migration target: no host routes.
fn skips_host_routes(call: &Call, result: &CniResult) -> bool {
    call.plan.ipam == IpamKind::Calico && result.routes.is_empty()
}

/// What getting a pod's addresses works with.
struct AddressRequestOf<'a> {
    cx: &'a AddCx<'a>,
    made: &'a Record<'a>,
    /// The call's arguments, host-local's pod CIDR applied.
    args: &'a CmdArgs,
    pod: &'a PodInfo,
    host_veth: &'a str,
    /// The pod's `hwAddr`.
    container_mac: Option<[u8; 6]>,
    /// The pod and its namespace as read (policy type k8s), for the IPAM.
    pod_read: Option<&'a PodInfo>,
    /// The endpoint's write that goes with Calico IPAM's block write.
    beside: Option<&'a dyn WriteBeside>,
}

impl AddressRequestOf<'_> {
    fn veth(&self, families: Option<Families>) -> VethRequest {
        veth_request(self.cx, self.host_veth, self.container_mac, families)
    }

    /// The pod's addresses from `source`, obtained while its interface is built: Calico
    /// IPAM (with the pool and family annotations, on the reads and lock of the first round
    /// trip), `ipAddrs` (each through calico-ipam, the endpoint's old addresses released
    /// first) or `ipAddrsNoIpam`.
    async fn addresses(
        &self,
        source: AddressSource,
        ipam_view: IpamView,
        old_addresses: &[String],
    ) -> Result<CniResult> {
        let (call, made, args) = (self.cx.call, self.made, self.args);
        match source {
            AddressSource::Ipam => {
                let mut ipam_args = args.clone();
                // With the pool and family annotations, the families are IPAM's to tell.
                let mut families = call.plan.families;
                if call.plan.ipam == IpamKind::Calico {
                    if let Some(stdin) = self.pod.ipam_stdin(&args.stdin_data)? {
                        ipam_args.stdin_data = stdin;
                        families = None;
                    }
                }
                let hints = AddHints {
                    pod: self.pod_read,
                    beside: self.beside,
                };
                let ipam = ipam_add(
                    self.cx,
                    made,
                    &ipam_args,
                    (ipam_view, hints),
                    EmptyIpamAnswer::MissingIpConfig,
                );
                addresses_and_interface(made, args, self.veth(families), ipam).await
            }
            AddressSource::IpAddrs(ips) => {
                // Each address is assigned by its own calico-ipam call, which takes the lock.
                drop(ipam_view);
                let ipam = async {
                    release_old_addresses(call, args, old_addresses).await?;
                    self.assign_each(&ips).await
                };
                let veth = self.veth(Some(families_of(&ips)));
                addresses_and_interface(made, args, veth, ipam).await
            }
            AddressSource::NoIpam(ips) => {
                drop(ipam_view);
                let result = CniResult {
                    ips: ips
                        .iter()
                        .map(|ip| IpConfig {
                            address: IpNet::host(*ip),
                            gateway: None,
                            interface: None,
                        })
                        .collect(),
                    ..Default::default()
                };
                let veth = self.veth(Some(families_of(&ips)));
                addresses_and_interface(made, args, veth, async { Ok(result) }).await
            }
        }
    }

    /// `ipAddrs`: calico-ipam once per address with `IP=<address>` added to CNI_ARGS. Each
    /// address is recorded as it is assigned: a failure leaves them to the rollback. The
    /// result holds the addresses and no routes, as upstream's.
    /// Each call asks for its address, so no pool is chosen: no namespace labels (upstream's
    /// calico-ipam reads the namespace only to choose pools).
    async fn assign_each(&self, ips: &[IpAddr]) -> Result<CniResult> {
        let args = self.args;
        let mut result = CniResult::default();
        for ip in ips {
            let mut one = args.clone();
            one.args = format!("{};IP={ip}", args.args);
            let got = self
                .cx
                .ipam
                .add(&one, Default::default(), Default::default())
                .await;
            if let Ok(r) = &got {
                self.made.addresses_given(args, &addresses_of(r));
            }
            let first = got.and_then(|r| match r.ips.first() {
                Some(first) => Ok((first.clone(), r.routes)),
                None => Err(EmptyIpamAnswer::MissingIpConfig.into()),
            });
            // As upstream's result, built from each answer's first address alone: no
            // routes, so (with calico-ipam) no host routes either.
            let (first, _routes) =
                first.map_err(|e| Error::chain("error getting IP from IPAM", e))?;
            result.ips.push(first);
        }
        Ok(result)
    }
}

/// `ipAddrs` on a re-ADD: the endpoint's previous addresses are released first.
async fn release_old_addresses(call: &Call, args: &CmdArgs, old: &[String]) -> Result<()> {
    let ips: Vec<IpAddr> = old
        .iter()
        .filter_map(|s| s.parse::<IpNet>().ok())
        .map(|n| n.addr)
        .collect();
    if ips.is_empty() {
        return Ok(());
    }
    info!(
        ?ips,
        "releasing the endpoint's previous addresses before ipAddrs"
    );
    release_any(&call.ds, args, &ips)
        .await
        .context("failed to release ipAddrs")
}

/// The k8s endpoint as upstream builds it: a new one, or the existing one with every field
/// the CNI owns rebuilt (labels, generateName, identifiers, ports, addresses, service
/// account, profiles, spoofing prefixes) so nothing stale survives a re-ADD.
fn k8s_endpoint(call: &Call, existing: Option<WorkloadEndpoint>, name: &str) -> WorkloadEndpoint {
    let ids = &call.ids;
    let Some(mut w) = existing else {
        let mut w = endpoint::new_endpoint(ids, name, &call.conf.name);
        w.spec.interface_name = ids.host_veth_name();
        return w;
    };
    info!(name = %w.metadata.name, "re-networking existing endpoint");
    w.metadata.name = name.to_string();
    w.metadata.namespace = ids.namespace.clone();
    // Without policy type k8s there are no pod labels: the store adds its own two.
    w.metadata.labels = Some(Default::default());
    w.metadata.generate_name.clear();
    let s = &mut w.spec;
    s.node = ids.node.clone();
    s.orchestrator = ids.orchestrator.clone();
    s.pod = ids.pod.clone();
    s.ports.clear();
    s.ip_networks.clear();
    s.service_account_name.clear();
    s.profiles = vec![call.conf.name.clone()];
    s.allow_spoofed_source_prefixes.clear();
    s.container_id = ids.container_id.clone();
    s.interface_name = ids.host_veth_name();
    s.mac.clear();
    w
}

/// `0.0.0.0/0` and `::/0`.
pub(crate) fn default_routes() -> Vec<IpNet> {
    vec![
        IpNet::new(IpAddr::from([0u8; 4]), 0),
        IpNet::new(IpAddr::from([0u16; 8]), 0),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// k8s.go's pod routes: with host-local, its `ipam.routes` destinations (gateways ignored,
/// routes without `dst` skipped), after the defaults when `include_default_routes`;
/// otherwise, or when there are none, the default routes.
pub(crate) fn k8s_routes(conf: &crate::config::NetConf) -> Result<Vec<IpNet>> {
    if IpamKind::of(&conf.ipam.ipam_type) != IpamKind::HostLocal {
        return Ok(default_routes());
    }
    let Some(routes) = &conf.ipam.routes else {
        return Ok(default_routes());
    };
    let Value::Array(list) = routes else {
        return Err(HostLocalError::RoutesNotAList(routes.clone()).into());
    };
    let mut custom = Vec::new();
    for r in list {
        let Value::Object(route) = r else {
            return Err(HostLocalError::RouteNotAnObject(r.clone()).into());
        };
        let Some(dst) = route.get("dst") else {
            tracing::debug!("Ignoring host-ipam route with no dst");
            continue;
        };
        let Value::String(dst) = dst else {
            return Err(HostLocalError::RouteDstNotAString(dst.clone()).into());
        };
        let net: IpNet = dst.parse().map_err(Error::Cidr)?;
        custom.push(net.masked());
    }
    if custom.is_empty() {
        return Ok(default_routes());
    }
    if conf.include_default_routes {
        let mut all = default_routes();
        all.extend(custom);
        return Ok(all);
    }
    Ok(custom)
}
