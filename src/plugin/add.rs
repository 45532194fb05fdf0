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
//! The veth pair is built while IPAM allocates (`alongside`), or, for a Kubernetes pod,
//! already while the first reads are answered; on etcd with policy type k8s, Calico IPAM
//! assigns then too, and the pair gets those addresses and routes (`early`: an ADD refused
//! before using them undoes them). The addresses, routes and endpoint follow once both are
//! done. A failure of either undoes the other's work (IPAM failed: the pair is removed; the
//! pair failed: the addresses are given back).
//!
//! The undo runs within the call's grace (`deadline::cleanup_bound`): after a failure at the
//! deadline it may go on for `deadline::GRACE` more, so an ADD returns within its budget plus
//! the grace, having undone what the datastore let it undo.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde_json::Value;
use tracing::{info, warn};

use crate::cluster_ready::check_datastore_ready;
use crate::dataplane::grpc::GrpcDataplane;
use crate::dataplane::{AddressRequest, Families, Selected, VethRequest};
use crate::datastore::backend::Backend;
use crate::datastore::model::{Profile, WorkloadEndpoint};
use crate::datastore::validate;
use crate::datastore::Datastore;
use crate::error::{Context, Error, Result};
use crate::ipam::allocator::{Ipam, ViewReads, WriteBeside};
use crate::ipam::lock::IpamLock;
use crate::ipam_driver::exec::{host_local_add_stdin, uses_pod_cidr};
use crate::ipam_driver::{calico, kubevirt, IpamDriver, IpamKind, Prepared};
use crate::net::IpNet;
use crate::plugin::add_tail::{
    address_request, alongside, network_and_write, undo, EndpointBeside, Extras, Tail,
};
use crate::plugin::early::{self, Early, PodLink};
use crate::plugin::endpoint;
use crate::plugin::endpoint_status;
use crate::plugin::k8s_pod::{self, AddressSource, PodInfo};
use crate::plugin::plan::{expected_families, families_of};
use crate::plugin::readiness;
use crate::plugin::sandbox_lock::SandboxLock;
use crate::plugin::{connect, load_config, nodename, Call};
use crate::skel::error::CODE_INVALID_ENV;
use crate::skel::result::IpConfig;
use crate::skel::{CmdArgs, CniError, CniResult};

pub async fn cmd_add(args: &CmdArgs) -> Result<CniResult> {
    let conf = load_config(args)?;
    crate::deadline::extend(configured_waits(&conf));
    // Before anything is read or built: a pod scheduled before calico/node has started waits
    // for it (for at most half the time left), instead of failing at once as upstream.
    nodename::wait_for_file(&conf).await?;
    let mtu = conf.resolve_mtu()?;
    refuse_name_template(&args.ifname)?;
    // The netlink handles on both sides are opened while the datastore is connected to and
    // read (opening them creates nothing; their error, if any, is reported where the veth
    // pair is built).
    // With the gRPC dataplane there is nothing to open (a wrong `dataplane_options` is
    // reported by `check_dataplane` below, before anything is built).
    let grpc = GrpcDataplane::for_conf(&conf, mtu).ok().flatten();
    let families = expected_families(IpamKind::of(&conf.ipam.ipam_type), &conf, args);
    let dataplane = Selected::pick(grpc, args.netns.clone(), families);
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
    // With calico-ipam in-process, AutoAssign's reads join this round trip and the host's
    // IPAM lock is taken now (they are the same reads, as after the gate, and the lock is
    // the same). Not with readiness gates, which may wait: the lock would be held meanwhile.
    let early_ipam = plan.k8s && conf.readiness_gates.is_empty() && plan.ipam_in_process;
    // A Kubernetes pod's veth pair is built with these reads (`early`): not where a
    // readiness gate may wait (the pair would stand meanwhile), nor for a dataplane
    // configuration that is refused below.
    let mut work = Early::new(dataplane);
    let early_veth = (plan.k8s
        && conf.readiness_gates.is_empty()
        && conf.check_dataplane().is_ok())
    .then(|| {
        veth_request(
            args,
            &call,
            &call.ids.host_veth_name(),
            mtu,
            None,
            plan.families,
        )
    });
    let speculate = assigns_before_pod(&call);
    let (first, existing, profile_exists, pod) = tokio::join!(
        async {
            let (gate, ()) = tokio::join!(
                async {
                    let (ready, early) = tokio::join!(
                        check_datastore_ready(&call.ds),
                        early_ipam_reads(&call, early_ipam)
                    );
                    let (early, assigned) = match speculate && ready.is_ok() {
                        true => assign_before_pod(&call, args, early).await,
                        false => (early, None),
                    };
                    (ready, early, assigned)
                },
                async {
                    if let Some(req) = early_veth {
                        work.build_pair(req).await;
                    }
                }
            );
            let (ready, early, assigned) = gate;
            work.set_addresses(assigned);
            // With the early addresses and pair, their addresses and routes too: after the
            // pod's answer only the endpoint's write is left.
            if let (Ok(()), Ok(routes)) = (&ready, k8s_routes(conf)) {
                work.finish_ahead(|assigned| pod_addresses(&call, assigned, routes))
                    .await;
            }
            (ready, early)
        },
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
            let client = call.ds.plugin_kube_client(conf).await?;
            k8s_pod::read(
                &client,
                &call.ids.namespace,
                &call.ids.pod,
                &call.ids.pod_uid,
            )
            .await
            .map(Some)
        }
    );
    let (ready, early) = first;
    let outcome = after_reads(
        args,
        &call,
        mtu,
        (ready, existing, profile_exists, pod, early),
        &mut work,
    )
    .await;
    if outcome.is_err() {
        work.discard(&call, args).await;
    }
    outcome
}

/// With calico-ipam in-process, AutoAssign's reads join the first round trip and the host's
/// IPAM lock is taken then (`on`).
async fn early_ipam_reads(call: &Call, on: bool) -> EarlyIpam {
    if !on {
        return EarlyIpam::default();
    }
    let conf = &call.conf;
    // On the Kubernetes datastore the connection (its TLS handshake) is opened before
    // the host's IPAM lock is taken, not while it is held: other pods' ADDs on this
    // node wait for the lock.
    if let Some(client) = call.ds.kube_client().filter(|_| call.ds.is_kubernetes()) {
        client.open().await;
    }
    let ipam = Ipam::new(&call.ds, &call.ids.node);
    // Where the holders keep the blocks they write (the Kubernetes datastore), the
    // lock is taken only once the reads are answered, and held for the writes: the
    // node's other ADDs and DELs wait for it, and these reads are the slower half of
    // what it guards when many pods start at once. The hinted blocks are then taken
    // from the copies, under the lock (no request), and a listing of this host's
    // affinities that does not cover them is asked again (`Ipam::complete_view`).
    // On etcd, whose reads are fast and whose holders keep no copies, the reads are
    // made under the lock, where they cannot be behind another holder's writes.
    if call.ds.keeps_block_copies() {
        let reads = ipam.read_view_unlocked().await;
        let lock = IpamLock::acquire(conf.ipam_lock_file()).await;
        let reads = ipam
            .complete_view(reads, lock.block_hint(), &lock.hinted_copies())
            .await;
        return EarlyIpam {
            lock: Some(lock),
            reads: Some(reads),
        };
    }
    let lock = IpamLock::acquire(conf.ipam_lock_file()).await;
    let reads = ipam
        .read_view(lock.block_hint(), &lock.hinted_copies())
        .await;
    EarlyIpam {
        lock: Some(lock),
        reads: Some(reads),
    }
}

/// Whether Calico IPAM assigns before the pod is read (`early`): on etcd with policy type
/// k8s, where the pod comes from the API server, slower than etcd's reads and write. Not
/// where the pod may change how IPAM runs in ways only the pod tells: a KubeVirt VM's pod
/// (its handle is the VM's). Not without the early reads (readiness gates; IPAM run as a
/// plugin). The pool and family annotations, `ipAddrs` and `ipAddrsNoIpam` are seen once
/// the pod is read: the addresses are then given back (`addresses_alongside`).
fn assigns_before_pod(call: &Call) -> bool {
    let plan = &call.plan;
    plan.policy_k8s
        && !plan.endpoint_from_pod
        && plan.ipam == IpamKind::Calico
        && plan.ipam_in_process
        && call.conf.readiness_gates.is_empty()
        && !kubevirt::may_be_vm_pod(&call.ids)
}

/// Calico IPAM's assignment before the pod is read, once the ready gate has passed, with
/// the early reads and lock. Only if no pool has a `namespaceSelector` (the namespace's
/// labels come with the pod): else the early reads are kept for the assignment after it.
async fn assign_before_pod(
    call: &Call,
    args: &CmdArgs,
    early: EarlyIpam,
) -> (EarlyIpam, Option<Result<CniResult>>) {
    let selectorless = early
        .reads
        .as_ref()
        .and_then(ViewReads::pools)
        .is_some_and(|pools| pools.iter().all(|p| p.spec.namespace_selector.is_empty()));
    if !selectorless {
        return (early, None);
    }
    let prepared = Prepared {
        pod_vmi: None,
        namespace_labels: BTreeMap::new(),
        reads: early.reads,
        lock: early.lock,
        beside: None,
    };
    let assigned = ipam_add(call, args, prepared, MISSING_IP_CONFIG).await;
    (EarlyIpam::default(), Some(assigned))
}

/// What the first round trip answered, in `cmd_add`'s join order.
type FirstReads = (
    Result<()>,
    Result<Option<WorkloadEndpoint>>,
    Result<bool>,
    Result<Option<PodInfo>>,
    EarlyIpam,
);

/// ADD once its first reads are answered: the checks, then IPAM with the veth pair, the
/// addresses and routes, and the endpoint. A failure leaves in `work` what was started
/// with the reads and not yet used: `cmd_add` undoes it.
async fn after_reads(
    args: &CmdArgs,
    call: &Call,
    mtu: u32,
    (ready, existing, profile_exists, pod, early): FirstReads,
    work: &mut Early,
) -> Result<CniResult> {
    let conf = &call.conf;
    let plan = &call.plan;
    let (want_profile, endpoint_from_pod) = (plan.want_profile, plan.endpoint_from_pod);
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
        add_k8s(args, call, existing, profile, mtu, pod, early, work).await?
    } else {
        add_cni(args, call, existing, profile, mtu, work).await?
    };
    // Calico IPAM sets no gateway; host-local's is meaningless for a /32 interface.
    for ip in &mut result.ips {
        ip.gateway = None;
    }
    Ok(result)
}

/// How much longer than its own work the configuration may make ADD wait: each readiness
/// gate, and `policy_setup_timeout_seconds`. The call's deadline grows by this much, so a
/// configured wait is never cut short by it (upstream has no deadline at all).
fn configured_waits(conf: &crate::config::NetConf) -> std::time::Duration {
    let gates = u32::try_from(conf.readiness_gates.len()).unwrap_or(u32::MAX);
    readiness::MAX_WAIT_PER_GATE
        .saturating_mul(gates)
        .saturating_add(endpoint_status::max_wait(conf.policy_setup_timeout_seconds))
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
    work: &mut Early,
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

    // The namespace of a Mesos task's labels is in the identifiers already.
    let labels = conf.mesos_labels().labels;
    let name = endpoint_name(call, None)?;
    let mut wep = endpoint::new_endpoint(&call.ids, &name, &conf.name);
    if !labels.is_empty() {
        wep.metadata.labels = Some(labels);
    }
    wep.spec.interface_name = call.ids.host_veth_name();
    validate_and_ensure_profile(call, &wep, profile).await?;

    let veth = veth_request(
        args,
        call,
        &wep.spec.interface_name,
        mtu,
        None,
        call.plan.families,
    );
    let ipam = ipam_add(
        call,
        args,
        Prepared::default(),
        "IPAM plugin returned no IP addresses in result",
    );
    let driver = call.ipam();
    let tail = tail(call, &driver);
    let (result, link) = alongside(&tail, args, work.take_pair()?, veth, ipam).await?;
    let routes = default_routes();
    network_and_write(
        &tail,
        args,
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
    work: &mut Early,
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

    let host_veth = &wep.spec.interface_name;
    let veth = |families| veth_request(args, call, host_veth, mtu, extras.container_mac, families);
    let driver = call.ipam();
    let mut tail = tail(call, &driver);
    // On the Kubernetes datastore, a pod no ADD has networked yet gets its endpoint (the
    // address annotations) with Calico IPAM's block write: one round trip less.
    let beside = (call.ds.is_kubernetes()
        && call.plan.ipam == IpamKind::Calico
        && call.plan.ipam_in_process
        && old_addresses.is_empty())
    .then(|| EndpointBeside::new(&call.ds, &wep));
    tail.beside = beside.as_ref();
    let (result, link) = addresses_alongside(
        call,
        &tail,
        args,
        work,
        source,
        (&pod, early, &old_addresses),
        veth,
    )
    .await?;
    extras.skip_host_routes = skips_host_routes(call, &result);
    let result = network_and_write(&tail, args, result, link, wep, routes, extras, mtu).await?;
    endpoint_status::wait_for_policy(
        &conf.endpoint_status_dir,
        &ids.namespace,
        &name,
        conf.policy_setup_timeout_seconds,
    )
    .await;
    Ok(result)
}

/// A calico-ipam result without routes is a KubeVirt migration target: no host routes.
fn skips_host_routes(call: &Call, result: &CniResult) -> bool {
    call.plan.ipam == IpamKind::Calico && result.routes.is_empty()
}

/// What a Kubernetes pod's interface is given for IPAM's `result`, as `add_k8s` gives it.
fn pod_addresses(call: &Call, result: &CniResult, routes: Vec<IpNet>) -> AddressRequest {
    address_request(
        result,
        routes,
        call.conf.container_settings.allow_ip_forwarding,
        skips_host_routes(call, result),
    )
}

/// Where a Kubernetes pod's addresses come from (`AddressSource`), obtained while the
/// interface is built (`alongside`): Calico IPAM (with the pool and family annotations),
/// `ipAddrs` (each through calico-ipam, the endpoint's old addresses released first) or
/// `ipAddrsNoIpam`.
async fn addresses_alongside<I: IpamDriver>(
    call: &Call,
    tail: &Tail<'_, Backend, I>,
    args: &CmdArgs,
    work: &mut Early,
    source: AddressSource,
    (pod, early, old_addresses): (&PodInfo, EarlyIpam, &[String]),
    veth: impl Fn(Option<Families>) -> VethRequest,
) -> Result<(CniResult, PodLink)> {
    // Addresses assigned before the pod was read, for the configuration's pools and
    // families, are kept only if the pod and its namespace ask for nothing else. They stay
    // in `work` until then, so that a failure before gives them back. So does the pair
    // finished for them, which is kept only if the pod asks for the same pair; else it is
    // taken down before the addresses can be given back.
    let later = |(result, link)| (result, PodLink::Later(link));
    match source {
        AddressSource::Ipam => {
            let mut ipam_args = args.clone();
            // With the pool and family annotations, the families are IPAM's to tell.
            let mut families = call.plan.families;
            let mut annotated = false;
            if call.plan.ipam == IpamKind::Calico {
                if let Some(stdin) = pod.ipam_stdin(&args.stdin_data)? {
                    ipam_args.stdin_data = stdin;
                    families = None;
                    annotated = true;
                }
            }
            if !annotated {
                if let Some(finished) = work.take_finished(&veth(families)) {
                    return Ok(finished);
                }
            }
            work.unfinish().await?;
            match work.take_addresses() {
                Some(answer) if !annotated => {
                    let pair = work.take_pair()?;
                    return alongside(tail, args, pair, veth(families), async { answer })
                        .await
                        .map(later);
                }
                Some(answer) => give_back_before_pod(call, args, answer).await,
                None => {}
            }
            let prepared = Prepared {
                pod_vmi: pod.kubevirt.clone(),
                namespace_labels: namespace_labels(call, pod).await?,
                reads: early.reads,
                lock: early.lock,
                beside: tail.beside.map(|b| b as &dyn WriteBeside),
            };
            let ipam = ipam_add(call, &ipam_args, prepared, MISSING_IP_CONFIG);
            alongside(tail, args, work.take_pair()?, veth(families), ipam)
                .await
                .map(later)
        }
        AddressSource::IpAddrs(ips) => {
            // Each address is assigned by its own calico-ipam call, which takes the lock.
            drop(early);
            work.unfinish().await?;
            if let Some(answer) = work.take_addresses() {
                give_back_before_pod(call, args, answer).await;
            }
            let labels = namespace_labels(call, pod).await?;
            let ipam = async {
                release_old_addresses(call, args, old_addresses).await?;
                assign_each(call, args, &ips, labels).await
            };
            let families = Some(families_of(&ips));
            alongside(tail, args, work.take_pair()?, veth(families), ipam)
                .await
                .map(later)
        }
        AddressSource::NoIpam(ips) => {
            drop(early);
            work.unfinish().await?;
            if let Some(answer) = work.take_addresses() {
                give_back_before_pod(call, args, answer).await;
            }
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
            alongside(tail, args, work.take_pair()?, veth(families), async {
                Ok(result)
            })
            .await
            .map(later)
        }
    }
}

/// The pod asks for other addresses than those assigned before it was read: they are given
/// back first. An assignment that failed is only logged: the pod's own may succeed (what
/// an unanswered write may have assigned is under the handle, which the pod's DEL releases).
async fn give_back_before_pod(call: &Call, args: &CmdArgs, answer: Result<CniResult>) {
    match answer {
        Ok(assigned) => {
            info!(
                "the pod asks for other addresses: giving back those assigned before it was read"
            );
            undo(
                "giving back the addresses assigned before the pod was read",
                early::give_back(call, args, &assigned),
            )
            .await;
        }
        Err(e) => {
            info!(error = %e, "the assignment before the pod was read failed; the pod asks for other addresses")
        }
    }
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
                Err(Error::msg(MISSING_IP_CONFIG))
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

/// The host's IPAM lock and AutoAssign's reads, taken in the first round trip.
#[derive(Default)]
struct EarlyIpam {
    lock: Option<IpamLock>,
    reads: Option<ViewReads>,
}

/// ADD's tail on the call's datastore and IPAM.
fn tail<'a, I>(call: &'a Call, ipam: &'a I) -> Tail<'a, Backend, I> {
    Tail {
        ds: &call.ds,
        ipam,
        allow_ip_forwarding: call.conf.container_settings.allow_ip_forwarding,
        beside: None,
    }
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

/// Upstream's refusal of a Kubernetes pod's IPAM result without addresses.
const MISSING_IP_CONFIG: &str = "IPAM plugin returned missing IP config";

/// Runs the IPAM plugin; a result without addresses is given back and refused with `empty`.
async fn ipam_add(
    call: &Call,
    args: &CmdArgs,
    prepared: Prepared<'_>,
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

/// What the dataplane's `prepare` makes for this endpoint: the pair, named `CNI_IFNAME` in the pod
/// and the endpoint's interface name on the host.
fn veth_request(
    args: &CmdArgs,
    call: &Call,
    host_veth: &str,
    mtu: u32,
    container_mac: Option<[u8; 6]>,
    families: Option<Families>,
) -> VethRequest {
    VethRequest {
        netns_path: args.netns.clone(),
        ifname: args.ifname.clone(),
        host_veth: host_veth.to_string(),
        mtu,
        num_queues: call.conf.num_queues(),
        container_mac,
        families,
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NetConf;

    fn routes(json: &str) -> Result<Vec<String>> {
        let conf = NetConf::parse(json.as_bytes()).unwrap();
        k8s_routes(&conf).map(|r| r.iter().map(IpNet::to_string).collect())
    }

    #[test]
    fn configured_waits_cover_every_gate_and_the_policy_wait() {
        let conf = |extra: &str| {
            crate::config::NetConf::parse(format!(r#"{{"name":"n"{extra}}}"#).as_bytes()).unwrap()
        };
        let secs = std::time::Duration::from_secs;
        assert_eq!(configured_waits(&conf("")), secs(0));
        assert_eq!(
            configured_waits(&conf(r#","readiness_gates":["http://a/","http://b/"]"#)),
            secs(70)
        );
        assert_eq!(
            configured_waits(&conf(r#","policy_setup_timeout_seconds":45"#)),
            secs(45)
        );
        assert_eq!(
            configured_waits(&conf(r#","policy_setup_timeout_seconds":-1"#)),
            secs(0),
            "refused later, with its own error"
        );
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
