//! `calico` ADD (plugin.go cmdAdd, k8s.go CmdAddK8s): find the endpoint, get addresses from
//! the IPAM plugin, build the veth pair and routes, write the WorkloadEndpoint, and return
//! the result.
//!
//! Unlike upstream, everything that can be checked is checked before IPAM (the endpoint's
//! name and validity, the Profile, dataplane options, timeouts), and the Profile is ensured
//! before IPAM too, so that after IPAM the only failures left are the dataplane's and the
//! endpoint write's. Those undo exactly what this call made: the veth pair it created, the
//! addresses it was given and an endpoint whose write may have landed unanswered — never a
//! pre-existing interface, never an address another ADD of the same sandbox holds under the
//! same handle.
//!
//! The veth pair is built while IPAM allocates (`alongside`): it is started only once
//! everything before IPAM has passed, and the addresses, routes and endpoint follow once
//! both are done. A failure of either undoes the other's work (IPAM failed: the pair is
//! removed; the pair failed: the addresses are given back).
//!
//! The undo runs within the call's grace (`deadline::cleanup_bound`): after a failure at the
//! deadline it may go on for `deadline::GRACE` more, so an ADD returns within its budget plus
//! the grace, having undone what the datastore let it undo.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::IpAddr;

use serde_json::Value;
use tracing::{info, warn};

use crate::cluster_ready::check_datastore_ready;
use crate::dataplane::grpc::GrpcDataplane;
use crate::dataplane::{
    self, AddressRequest, DataplaneError, Families, PodFacts, PodLink, VethRequest,
};
use crate::datastore::kubernetes::core_objects;
use crate::datastore::model::{IpNat, Profile, WorkloadEndpoint, WorkloadEndpointSpec};
use crate::datastore::resources::{delete_resource, get_resource};
use crate::datastore::{validate, DatastoreError, Kind};
use crate::deadline;
use crate::error::{Context, Error, Result};
use crate::ipam::allocator::{Ipam, ViewReads};
use crate::ipam::lock::IpamLock;
use crate::ipam_driver::exec::{host_local_add_stdin, uses_pod_cidr};
use crate::ipam_driver::{calico, IpamDriver, IpamKind, Prepared};
use crate::net::IpNet;
use crate::plugin::endpoint;
use crate::plugin::endpoint_status;
use crate::plugin::k8s_pod::{self, AddressSource, PodInfo};
use crate::plugin::plan::{expected_families, families_of};
use crate::plugin::readiness;
use crate::plugin::sandbox_lock::SandboxLock;
use crate::plugin::{connect, load, Call};
use crate::skel::error::CODE_INVALID_ENV;
use crate::skel::result::IpConfig;
use crate::skel::{CmdArgs, CniError, CniResult};

pub async fn cmd_add(args: &CmdArgs) -> Result<CniResult> {
    let conf = load(args)?;
    let mtu = conf.resolve_mtu()?;
    refuse_name_template(&args.ifname)?;
    // The netlink handles on both sides are opened while the datastore is connected to and
    // read (opening them creates nothing; their error, if any, is reported where the veth
    // pair is built).
    // With the gRPC dataplane there is nothing to open (a wrong `dataplane_options` is
    // reported by `check_dataplane` below, before anything is built).
    let grpc = GrpcDataplane::for_conf(&conf, mtu).ok().flatten();
    let families = expected_families(IpamKind::of(&conf.ipam.ipam_type), &conf, args);
    let handles = tokio::spawn(dataplane::Handles::open(args.netns.clone(), families, grpc));
    let call = connect(args, conf, true).await?;
    let conf = &call.conf;
    // Before anything is read or written: no other ADD of this pod interface may run
    // meanwhile (`sandbox_lock`); held until this call returns, its undo included.
    let _sandbox = SandboxLock::try_acquire(conf.ipam_lock_file(), &call.ids.host_veth_name())?;

    // The ready gate, the endpoint lookup, the profile lookup and (policy type k8s) the pod
    // and its namespace are independent reads: one round trip. Nothing is written before
    // the gate has passed. On the Kubernetes datastore the endpoint is the pod itself, so
    // the pod is read once.
    let plan = &call.plan;
    let (want_profile, policy_k8s) = (plan.want_profile, plan.policy_k8s);
    let endpoint_from_pod = plan.endpoint_from_pod;
    // With calico-ipam in-process, the host's IPAM lock is taken now and AutoAssign's reads
    // join this round trip (they are the same reads, under the same lock, as after the
    // gate). Not with readiness gates, which may wait: the lock would be held meanwhile.
    let early_ipam = plan.k8s && conf.readiness_gates.is_empty() && plan.ipam_in_process;
    let (ready, existing, profile_exists, pod, early) = tokio::join!(
        check_datastore_ready(&call.ds),
        async {
            if endpoint_from_pod {
                Ok(None)
            } else {
                endpoint::find_existing(&call.ds, &call.ids).await
            }
        },
        async {
            if want_profile {
                endpoint::profile_exists(&call.ds, &conf.name).await
            } else {
                Ok(true)
            }
        },
        async {
            if !policy_k8s {
                return Ok(None);
            }
            let client = core_objects::client_for(conf, &call.ds).await?;
            k8s_pod::read(&client, &call.ids.namespace, &call.ids.pod)
                .await
                .map(Some)
        },
        async {
            if !early_ipam {
                return EarlyIpam::default();
            }
            let lock = IpamLock::acquire(conf.ipam_lock_file()).await;
            let reads = Ipam::new(&call.ds, &call.ids.node)
                .read_view(lock.block_hint())
                .await;
            EarlyIpam {
                lock: Some(lock),
                reads: Some(reads),
            }
        }
    );
    ready?;
    readiness::wait_for_gates(&conf.readiness_gates).await?;
    let pod: Option<PodInfo> = pod?;
    let mut existing = existing?;
    if endpoint_from_pod {
        existing = pod
            .as_ref()
            .and_then(|p| p.endpoint.clone())
            .filter(|w| call.ids.name_matches(&w.metadata.name));
    }
    // Upstream's k8s path checks the dataplane first thing; its cni path only after IPAM.
    // Both are checked here, before anything is allocated.
    conf.check_dataplane()?;
    let profile = if want_profile && !profile_exists? {
        Some(endpoint::new_profile(&conf.name, call.ids.is_k8s()))
    } else {
        None
    };

    let mut result = if plan.k8s {
        add_k8s(args, &call, existing, profile, mtu, pod, early, handles).await?
    } else {
        add_cni(args, &call, existing, profile, mtu, handles).await?
    };
    // Calico IPAM sets no gateway; host-local's is meaningless for a /32 interface.
    for ip in &mut result.ips {
        ip.gateway = None;
    }
    Ok(result)
}

/// A `%` in the interface name is the kernel's name template (`eth%d` becomes `eth0`): the
/// pair would be created under another name and never removed. Refused before anything.
fn refuse_name_template(ifname: &str) -> Result<()> {
    if ifname.contains('%') {
        return Err(Error::Cni(CniError::new(
            CODE_INVALID_ENV,
            "interface name contains '%', which the kernel treats as a name template",
            ifname,
        )));
    }
    Ok(())
}

/// The endpoint's name: the existing one's, else built from the identifiers (which fails,
/// before IPAM, for a segment starting or ending with `-`).
fn endpoint_name(call: &Call, existing: Option<&WorkloadEndpoint>) -> Result<String> {
    match existing {
        Some(w) => Ok(w.metadata.name.clone()),
        None => Ok(call.ids.wep_name()?),
    }
}

/// Checks the endpoint (as it will be written, minus what IPAM and the dataplane add) and
/// the Profile as libcalico-go's validator would, then creates the Profile if it is new.
async fn validate_and_ensure_profile(
    call: &Call,
    wep: &WorkloadEndpoint,
    profile: Option<Profile>,
) -> Result<()> {
    validate::workload_endpoint(wep)?;
    if let Some(mut p) = profile {
        validate::profile(&p)?;
        endpoint::create_profile(&call.ds, &mut p).await?;
    }
    Ok(())
}

async fn add_cni(
    args: &CmdArgs,
    call: &Call,
    existing: Option<WorkloadEndpoint>,
    profile: Option<Profile>,
    mtu: u32,
    handles: Handles,
) -> Result<CniResult> {
    let conf = &call.conf;
    if conf.feature_control.ip_addrs_no_ipam {
        return Err(Error::msg(
            "requested feature is not supported for this runtime: ip_addrs_no_ipam",
        ));
    }
    if let Some(mut wep) = existing {
        // Same container added again (or to a second network): record the profile, report
        // the addresses it has, touch nothing else.
        if !wep.spec.profiles.iter().any(|p| p == &conf.name) {
            info!(profile = %conf.name, "Calico CNI appending profile");
            wep.spec.profiles.push(conf.name.clone());
        }
        validate_and_ensure_profile(call, &wep, profile).await?;
        let result = endpoint::result_from_endpoint(&wep, &args.ifname, mtu, &args.netns);
        endpoint::write(&call.ds, &mut wep).await?;
        return Ok(result);
    }

    let mut ids = call.ids.clone();
    let mut labels = conf.mesos_labels();
    if let Some(ns) = labels.remove("projectcalico.org.namespace") {
        ids.namespace = ns;
    }
    let name = endpoint_name(call, None)?;
    let mut wep = endpoint::new_endpoint(&ids, &name, &conf.name);
    if !labels.is_empty() {
        wep.metadata.labels = Some(labels);
    }
    wep.spec.interface_name = ids.host_veth_name();
    validate_and_ensure_profile(call, &wep, profile).await?;

    let veth = veth_request(args, call, &wep, mtu, None, call.plan.families);
    let ipam = ipam_add(
        call,
        args,
        Prepared::default(),
        "IPAM plugin returned no IP addresses in result",
    );
    let (result, link) = alongside(call, args, handles, veth, ipam).await?;
    let routes = default_routes();
    network_and_write(
        args,
        call,
        result,
        link,
        wep,
        routes,
        Extras::default(),
        mtu,
    )
    .await
}

#[allow(clippy::too_many_arguments)]
async fn add_k8s(
    args: &CmdArgs,
    call: &Call,
    existing: Option<WorkloadEndpoint>,
    profile: Option<Profile>,
    mtu: u32,
    pod: Option<PodInfo>,
    early: EarlyIpam,
    handles: Handles,
) -> Result<CniResult> {
    let conf = &call.conf;
    let ids = &call.ids;
    // Upstream refuses a negative delay only after writing the endpoint (and leaks the IP).
    endpoint_status::validate_timeout(conf.policy_setup_timeout_seconds)?;
    let routes = k8s_routes(conf)?;
    let name = endpoint_name(call, existing.as_ref())?;
    let old_addresses: Vec<String> = existing
        .as_ref()
        .map(|w| w.spec.ip_networks.clone())
        .unwrap_or_default();
    let mut wep = k8s_endpoint(call, existing, &name);
    let pod = pod.unwrap_or_default();
    let mut extras = Extras::default();
    if conf.policy.policy_type == "k8s" {
        wep.metadata.labels = Some(pod.labels.clone());
        wep.metadata.generate_name = pod.generate_name.clone();
        wep.spec.ports = pod.ports.clone();
        wep.spec.profiles = pod.profiles.clone();
        wep.spec.service_account_name = pod.service_account.clone();
    }
    // Every annotation is checked before IPAM (upstream checks some after networking and
    // leaks the addresses when they are wrong).
    wep.spec.allow_spoofed_source_prefixes = pod.source_prefixes()?;
    extras.floating_ips = pod.floating_ips(conf)?;
    extras.container_mac = pod.hw_addr()?;
    extras.annotations = pod.annotations.clone();
    let source = pod.address_source(conf)?;
    let mut args = args.clone();
    if call.plan.ipam == IpamKind::HostLocal && uses_pod_cidr(&args.stdin_data) {
        let (v4, v6) = k8s_pod::node_pod_cidrs(call).await?;
        args.stdin_data = host_local_add_stdin(&args.stdin_data, &v4, &v6)?;
    }
    let args = &args;
    validate_and_ensure_profile(call, &wep, profile).await?;

    let veth = |families| veth_request(args, call, &wep, mtu, extras.container_mac, families);
    let (result, link) = match source {
        AddressSource::Ipam => {
            let mut ipam_args = args.clone();
            // With the pool and family annotations, the families are IPAM's to tell.
            let mut families = call.plan.families;
            if call.plan.ipam == IpamKind::Calico {
                if let Some(stdin) = pod.ipam_stdin(&args.stdin_data)? {
                    ipam_args.stdin_data = stdin;
                    families = None;
                }
            }
            let prepared = Prepared {
                namespace_labels: namespace_labels(call, &pod).await?,
                reads: early.reads,
                lock: early.lock,
            };
            let ipam = ipam_add(
                call,
                &ipam_args,
                prepared,
                "IPAM plugin returned missing IP config",
            );
            alongside(call, args, handles, veth(families), ipam).await?
        }
        AddressSource::IpAddrs(ips) => {
            // Each address is assigned by its own calico-ipam call, which takes the lock.
            drop(early);
            let labels = namespace_labels(call, &pod).await?;
            let ipam = async {
                release_old_addresses(call, args, &old_addresses).await?;
                assign_each(call, args, &ips, labels).await
            };
            let families = Some(families_of(&ips));
            alongside(call, args, handles, veth(families), ipam).await?
        }
        AddressSource::NoIpam(ips) => {
            drop(early);
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
            let families = Some(families_of(&ips));
            alongside(call, args, handles, veth(families), async { Ok(result) }).await?
        }
    };
    // A calico-ipam result without routes is a KubeVirt migration target: no host routes.
    extras.skip_host_routes = call.plan.ipam == IpamKind::Calico && result.routes.is_empty();
    let result = network_and_write(args, call, result, link, wep, routes, extras, mtu).await?;
    endpoint_status::wait_for_policy(
        &conf.endpoint_status_dir,
        &ids.namespace,
        &name,
        conf.policy_setup_timeout_seconds,
    )
    .await;
    Ok(result)
}

/// The namespace's labels for calico-ipam's pool selection: those already read with the
/// pod, else read when a kubeconfig is configured (as calico-ipam does).
async fn namespace_labels(call: &Call, pod: &PodInfo) -> Result<BTreeMap<String, String>> {
    if call.plan.ipam != IpamKind::Calico {
        return Ok(BTreeMap::new());
    }
    if call.conf.policy.policy_type == "k8s" {
        return Ok(pod.namespace_labels.clone());
    }
    calico::namespace_labels(&call.conf, &call.ids.namespace, &call.ds).await
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
    calico::release_any(&call.ds, args, &ips)
        .await
        .context("failed to release ipAddrs")
}

/// `ipAddrs`: calico-ipam once per address with `IP=<address>` added to CNI_ARGS. A
/// failure gives back the addresses already assigned.
async fn assign_each(
    call: &Call,
    args: &CmdArgs,
    ips: &[IpAddr],
    labels: BTreeMap<String, String>,
) -> Result<CniResult> {
    let mut result = CniResult::default();
    let mut assigned = Vec::new();
    for ip in ips {
        let mut one = args.clone();
        one.args = format!("{};IP={ip}", args.args);
        let prepared = Prepared {
            namespace_labels: labels.clone(),
            ..Default::default()
        };
        let got = call.ipam().add(&one, prepared).await.and_then(|r| {
            if r.ips.is_empty() {
                Err(Error::msg("IPAM plugin returned missing IP config"))
            } else {
                Ok(r)
            }
        });
        match got {
            Ok(r) => {
                assigned.push(r.ips[0].address.addr);
                result.ips.push(r.ips[0].clone());
                result.routes.extend(r.routes);
            }
            Err(e) => {
                undo(
                    "releasing the addresses already assigned",
                    call.ipam().give_back(args, &assigned),
                )
                .await;
                return Err(Error::chain("error getting IP from IPAM", e));
            }
        }
    }
    Ok(result)
}

/// The netlink handles, being opened (`cmd_add`).
type Handles = tokio::task::JoinHandle<dataplane::Handles>;

/// The host's IPAM lock and AutoAssign's reads, taken in the first round trip.
#[derive(Default)]
struct EarlyIpam {
    lock: Option<IpamLock>,
    reads: Option<ViewReads>,
}

/// What the annotations add to the interface and the endpoint.
#[derive(Default)]
struct Extras {
    container_mac: Option<[u8; 6]>,
    floating_ips: Vec<String>,
    skip_host_routes: bool,
    /// The pod's, for the gRPC dataplane.
    annotations: BTreeMap<String, String>,
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

/// Runs the IPAM plugin; a result without addresses is given back and refused with `empty`.
async fn ipam_add(
    call: &Call,
    args: &CmdArgs,
    prepared: Prepared,
    empty: &str,
) -> Result<CniResult> {
    let ipam = call.ipam();
    let result = ipam.add(args, prepared).await?;
    info!(ips = ?result.ips.iter().map(|i| i.address.to_string()).collect::<Vec<_>>(), "Got result from IPAM plugin");
    if result.ips.is_empty() {
        undo("releasing an empty IPAM result", async {
            if let Err(e) = ipam.del(args).await {
                warn!(error = %e, "failed to release IPAM allocation");
            }
        })
        .await;
        return Err(Error::msg(empty));
    }
    Ok(result)
}

/// What `dataplane::build` makes for this endpoint: the pair, named `CNI_IFNAME` in the pod
/// and the endpoint's interface name on the host.
fn veth_request(
    args: &CmdArgs,
    call: &Call,
    wep: &WorkloadEndpoint,
    mtu: u32,
    container_mac: Option<[u8; 6]>,
    families: Option<Families>,
) -> VethRequest {
    VethRequest {
        netns_path: args.netns.clone(),
        ifname: args.ifname.clone(),
        host_veth: wep.spec.interface_name.clone(),
        mtu,
        num_queues: call.conf.num_queues(),
        container_mac,
        families,
    }
}

/// Runs IPAM (`ipam`) and builds the veth pair at the same time. A failure of either undoes
/// the other: addresses without a pair are given back, a pair without addresses is removed.
/// When both fail, IPAM's error is the call's (it is what the sequential order reported).
async fn alongside(
    call: &Call,
    args: &CmdArgs,
    handles: Handles,
    veth: VethRequest,
    ipam: impl Future<Output = Result<CniResult>>,
) -> Result<(CniResult, PodLink)> {
    let build = async {
        let handles = handles
            .await
            .map_err(|e| DataplaneError::Internal(format!("opening the netlink handles: {e}")))?;
        dataplane::build(veth, handles).await
    };
    match tokio::join!(ipam, build) {
        (Ok(result), Ok(link)) => Ok((result, link)),
        (Err(e), Ok(link)) => {
            undo("removing the veth pair after IPAM failed", async {
                if let Err(undo) = link.remove().await {
                    warn!(error = %undo, "failed to remove the pod interface after IPAM failed");
                }
            })
            .await;
            Err(e)
        }
        (Err(e), Err(net)) => {
            warn!(error = %net, "the veth pair failed too (and was removed)");
            Err(e)
        }
        (Ok(result), Err(e)) => {
            let assigned: Vec<IpAddr> = result.ips.iter().map(|ip| ip.address.addr).collect();
            undo(
                "releasing the addresses after a failed dataplane setup",
                call.ipam().give_back(args, &assigned),
            )
            .await;
            Err(e.into())
        }
    }
}

/// The common tail of both modes: finish the interface, write the endpoint, shape the
/// result. A failure gives back this call's addresses and removes the veth pair it created.
#[allow(clippy::too_many_arguments)]
async fn network_and_write(
    args: &CmdArgs,
    call: &Call,
    mut result: CniResult,
    mut link: PodLink,
    mut wep: WorkloadEndpoint,
    routes: Vec<IpNet>,
    extras: Extras,
    mtu: u32,
) -> Result<CniResult> {
    wep.spec.ip_networks = endpoint::ip_networks(&result);
    wep.spec.ip_nats = floating_nats(&result, &extras.floating_ips);
    let assigned: Vec<IpAddr> = result.ips.iter().map(|ip| ip.address.addr).collect();
    let addrs = AddressRequest {
        ips: assigned.iter().map(|ip| IpNet::host(*ip)).collect(),
        routes,
        allow_ip_forwarding: call.conf.container_settings.allow_ip_forwarding,
        skip_host_routes: extras.skip_host_routes,
    };
    let pod = PodFacts {
        ips: &result.ips,
        endpoint: &wep,
        annotations: &extras.annotations,
    };
    let net = match link.finish(&addrs, &pod).await {
        Ok(n) => n,
        Err(e) => {
            undo(
                "releasing the addresses after a failed dataplane setup",
                call.ipam().give_back(args, &assigned),
            )
            .await;
            return Err(e.into());
        }
    };
    info!(host_veth = %net.host_veth, mac = %net.container_mac, "Networked namespace");
    wep.spec.mac = net.container_mac.to_lowercase();
    wep.spec.interface_name = net.host_veth.clone();
    let new_endpoint = wep.metadata.resource_version.is_empty();
    if let Err(e) = endpoint::write(&call.ds, &mut wep).await {
        undo("undoing a failed ADD", async {
            // The interface first: it is local and always possible (and its host route must
            // be gone before the address can go to another pod).
            if let Err(undo) = link.remove().await {
                warn!(error = %undo, "failed to remove the pod interface after a failed ADD");
            }
            if new_endpoint && outcome_unknown(&e) {
                remove_unanswered_endpoint(call, &wep).await;
            }
            call.ipam().give_back(args, &assigned).await;
        })
        .await;
        return Err(e);
    }
    info!(name = %wep.metadata.name, "Wrote endpoint to datastore");
    finish_result(
        &mut result,
        &net.host_veth,
        &args.ifname,
        &net.container_mac,
        mtu,
        &args.netns,
    );
    Ok(result)
}

/// Runs one step of undoing a failed ADD within the call's grace; a step cut short is
/// logged (what it could not undo, DEL will).
async fn undo(what: &str, step: impl Future<Output = ()>) {
    if let Err(e) = deadline::cleanup_bound(what, step).await {
        warn!(error = %e, "the undo of a failed ADD was cut short; DEL will finish it");
    }
}

/// Whether a failed write may have landed all the same (no answer, rather than a refusal).
fn outcome_unknown(e: &Error) -> bool {
    matches!(
        e,
        Error::Datastore(DatastoreError::Deadline(_) | DatastoreError::Unavailable(_))
    )
}

/// After the create of a new endpoint went unanswered: delete the endpoint if it was written
/// all the same (it is this call's: same container and addresses), so that no endpoint is
/// left naming addresses that are being given back.
async fn remove_unanswered_endpoint(call: &Call, wep: &WorkloadEndpoint) {
    let (ns, name) = (&wep.metadata.namespace, &wep.metadata.name);
    let read =
        get_resource::<_, WorkloadEndpointSpec>(&call.ds, Kind::WorkloadEndpoint, Some(ns), name)
            .await;
    let stored = match read {
        Ok(w) => w,
        Err(e) if e.is_not_found() => return,
        Err(e) => {
            warn!(error = %e, name, "cannot tell whether the endpoint was written");
            return;
        }
    };
    if stored.spec.container_id != wep.spec.container_id
        || stored.spec.ip_networks != wep.spec.ip_networks
    {
        return;
    }
    let rev = Some(stored.metadata.resource_version.as_str());
    match delete_resource(&call.ds, Kind::WorkloadEndpoint, Some(ns), name, rev).await {
        Ok(()) => info!(name, "deleted the endpoint whose write went unanswered"),
        Err(e) => warn!(error = %e, name, "failed to delete the endpoint of a failed ADD"),
    }
}

/// Floating IPs NATed to the pod's address of the same family.
fn floating_nats(result: &CniResult, floating: &[String]) -> Vec<IpNat> {
    let v4 = result.ips.iter().find(|i| i.address.addr.is_ipv4());
    let v6 = result.ips.iter().find(|i| i.address.addr.is_ipv6());
    floating
        .iter()
        .filter_map(|ext| {
            let internal = if ext.contains(':') { v6 } else { v4 };
            internal.map(|i| IpNat {
                internal_ip: i.address.addr.to_string(),
                external_ip: ext.clone(),
            })
        })
        .collect()
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
        return Err(Error::msg(format!(
            "failed to parse host-local IPAM routes section; expecting list, not: {routes}"
        )));
    };
    let mut custom = Vec::new();
    for r in list {
        let Value::Object(route) = r else {
            return Err(Error::msg(format!(
                "invalid IPAM routes section; expecting a route object, not: {r}"
            )));
        };
        let Some(dst) = route.get("dst") else {
            tracing::debug!("Ignoring host-ipam route with no dst");
            continue;
        };
        let Value::String(dst) = dst else {
            return Err(Error::msg(format!(
                "invalid IPAM routes section; expecting 'dst' to be a string, not: {dst}"
            )));
        };
        let net: IpNet = dst
            .parse()
            .map_err(|_| Error::msg(format!("invalid CIDR address: {dst}")))?;
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

/// Addresses as host networks on interface 1 (the container end), routes as IPAM gave them.
fn finish_result(
    result: &mut CniResult,
    host_veth: &str,
    ifname: &str,
    mac: &str,
    mtu: u32,
    netns: &str,
) {
    result.interfaces = endpoint::interfaces(host_veth, ifname, mac, mtu, netns);
    for ip in &mut result.ips {
        ip.address = IpNet::host(ip.address.addr);
        ip.interface = Some(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NetConf;

    fn routes(json: &str) -> Result<Vec<String>> {
        let conf = NetConf::parse(json.as_bytes()).unwrap();
        k8s_routes(&conf).map(|r| r.iter().map(IpNet::to_string).collect())
    }

    #[test]
    fn host_local_routes() {
        assert_eq!(
            routes(r#"{"name":"n","ipam":{"type":"calico-ipam","routes":[{"dst":"10.0.0.0/8"}]}}"#)
                .unwrap(),
            vec!["0.0.0.0/0", "::/0"]
        );
        // No dst: ignored, as upstream.
        assert_eq!(
            routes(r#"{"name":"n","ipam":{"type":"host-local","routes":[{"gw":"1.2.3.4"},{"dst":"10.123.4.5/16"}]}}"#)
                .unwrap(),
            vec!["10.123.0.0/16"]
        );
        assert_eq!(
            routes(r#"{"name":"n","include_default_routes":true,"ipam":{"type":"host-local","routes":[{"dst":"10.123.0.0/16"}]}}"#)
                .unwrap(),
            vec!["0.0.0.0/0", "::/0", "10.123.0.0/16"]
        );
        assert_eq!(
            routes(r#"{"name":"n","ipam":{"type":"host-local","routes":[{"gw":"1.2.3.4"}]}}"#)
                .unwrap(),
            vec!["0.0.0.0/0", "::/0"]
        );
        assert_eq!(
            routes(r#"{"name":"n","ipam":{"type":"host-local","routes":[{"dst":"bogus"}]}}"#)
                .unwrap_err()
                .to_string(),
            "invalid CIDR address: bogus"
        );
        assert!(
            routes(r#"{"name":"n","ipam":{"type":"host-local","routes":[{"dst":5}]}}"#).is_err()
        );
    }

    #[test]
    fn name_templates_are_refused() {
        let e = CniError::from(refuse_name_template("eth%d").unwrap_err());
        assert_eq!((e.code, e.details.as_str()), (4, "eth%d"));
        assert!(refuse_name_template("eth0").is_ok());
    }
}
