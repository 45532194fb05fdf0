//! `calico` ADD (plugin.go cmdAdd, k8s.go CmdAddK8s): find the endpoint, get addresses from
//! the IPAM plugin, build the veth pair and routes, write the WorkloadEndpoint, and return
//! the result.
//!
//! * `mod.rs` (here): the prelude (config, deadline, node name, datastore, the sandbox's
//!   lock), the first round trip (`first_reads`: the ready gate, the endpoint, the Profile,
//!   the pod and Calico IPAM's reads), the checks after it, then the orchestrator's path;
//! * `k8s.rs`: a Kubernetes pod (its annotations, where its addresses come from); `cni.rs`:
//!   any other container;
//! * `commit.rs`: IPAM alongside the interface, then the addresses and routes, the endpoint
//!   and the result;
//! * `interface.rs`: the pod interface's stages (built, finished, taken for removal);
//! * `rollback.rs`: the one record of what the call made (`Made`) and its one rollback.
//!
//! Unlike upstream, everything that can be checked is checked before IPAM (the endpoint's
//! name and validity, the Profile, dataplane options, annotations, timeouts), so that after
//! IPAM the only failures left are the dataplane's, the endpoint write's and the Profile's
//! create (last, as upstream's). A failure anywhere after the datastore is connected runs
//! `Made::rollback` once, here in `cmd_add`: it undoes exactly what this call made (the
//! interface it built, an endpoint whose write may have landed unanswered, the addresses it
//! was given), never a pre-existing interface, never an address another ADD of the same
//! sandbox holds under the same handle. Which steps start early or go together is decided
//! once, in the call's plan (`plan::AddSteps`).

mod cni;
mod commit;
mod interface;
mod k8s;
mod rollback;

use tracing::info;

use crate::call::cluster_ready::check_datastore_ready;
use crate::dataplane::grpc::GrpcDataplane;
use crate::dataplane::{Families, Selected, VethRequest};
use crate::datastore::backend::Backend;
use crate::datastore::model::{Profile, WorkloadEndpoint};
use crate::datastore::validate;
use crate::error::{EmptyIpamAnswer, Error, Result};
use crate::plugin::endpoint;
use crate::plugin::endpoint_status;
use crate::plugin::ipam::{AddHints, Driver, IpamDriver, IpamKind};
use crate::plugin::k8s_pod::{self, PodInfo};
use crate::plugin::plan::expected_families;
use crate::plugin::readiness;
use crate::plugin::sandbox_lock::SandboxLock;
use crate::plugin::{connect, load_config, nodename, Call, Verb};
use crate::skel::{CmdArgs, CniResult};

pub(crate) use k8s::{default_routes, k8s_routes};
use rollback::Made;

/// What every step of one ADD works with.
pub struct AddCx<'a> {
    pub args: &'a CmdArgs,
    pub call: &'a Call,
    /// The call's IPAM.
    pub ipam: &'a Driver<'a, Backend>,
    /// The interface's MTU (configured, else the host's).
    pub mtu: u32,
    /// The MTU the result reports: the interface's, or a negative one as configured (as
    /// upstream, which reports the NetConf's and never sets a negative one).
    pub result_mtu: i64,
}

/// The record of one ADD on the call's datastore, IPAM and dataplane.
type Record<'a> = Made<'a, Backend, Driver<'a, Backend>, Selected>;

/// What the call's IPAM reads ahead of ADD (`IpamDriver::read_view`).
pub type IpamView = <Driver<'static, Backend> as IpamDriver>::View;

pub async fn cmd_add(args: &CmdArgs) -> Result<CniResult> {
    let conf = load_config(args)?;
    crate::support::deadline::extend(configured_waits(&conf));
    // Before anything is read or built: a pod scheduled before calico/node has started waits
    // for it (for at most half the time left), instead of failing at once as upstream.
    nodename::wait_for_file(&conf).await?;
    let mtu = conf.resolve_mtu()?;
    refuse_name_template(&args.ifname)?;
    // The netlink handles on both sides are opened while the datastore is connected to and
    // read (opening them creates nothing; their error, if any, is reported where the veth
    // pair is built). With the gRPC dataplane there is nothing to open (a wrong
    // `dataplane_options` is reported by `check_dataplane`, before anything is built).
    let grpc = GrpcDataplane::for_conf(&conf, mtu).ok().flatten();
    let families = expected_families(IpamKind::of(&conf.ipam.ipam_type), &conf, args);
    let dataplane = Selected::pick(grpc, args.netns.clone(), families);
    let call = connect(args, conf, Verb::Add { families }).await?;
    // Before anything is read or written: no other ADD of this pod interface may run
    // meanwhile (`sandbox_lock`); held until this call returns, its rollback included.
    let _sandbox =
        SandboxLock::try_acquire(call.conf.ipam_lock_file(), &call.ids.host_veth_name())?;
    let driver = call.ipam();
    let made = Made::new(&call.ds, &driver, dataplane);
    let cx = AddCx {
        args,
        call: &call,
        ipam: &driver,
        mtu,
        result_mtu: match call.conf.mtu {
            m if m < 0 => m,
            _ => i64::from(mtu),
        },
    };
    let outcome = async {
        let reads = first_reads(&cx).await;
        check_then_add(&cx, &made, reads).await
    }
    .await;
    if outcome.is_err() {
        made.rollback().await;
    }
    outcome
}

/// What the first round trip answered.
struct FirstReads {
    ready: Result<()>,
    existing: Result<Option<WorkloadEndpoint>>,
    profile_exists: Result<bool>,
    pod: Result<Option<PodInfo>>,
    ipam: IpamView,
}

/// The ready gate, the endpoint lookup, the Profile lookup, (policy type k8s) the pod and
/// its namespace and (`AddSteps::ipam_view_in_first_round_trip`) the IPAM's view are
/// independent: one round trip. Nothing is written before the gate has passed. On the
/// Kubernetes datastore the endpoint is the pod itself, so the pod is read once.
async fn first_reads(cx: &AddCx<'_>) -> FirstReads {
    let call = cx.call;
    let plan = &call.plan;
    let (ready, ipam, existing, profile_exists, pod) = tokio::join!(
        check_datastore_ready(&call.ds),
        read_ipam_view(cx, plan.add.ipam_view_in_first_round_trip),
        async {
            match plan.endpoint_from_pod {
                true => Ok(None),
                false => endpoint::find_existing(&call.ds, &call.ids).await,
            }
        },
        async {
            match plan.want_profile {
                true => endpoint::profile_exists(&call.ds, &call.conf.name).await,
                false => Ok(true),
            }
        },
        async {
            if !plan.policy_k8s {
                return Ok(None);
            }
            let client = call.ds.plugin_kube_client(&call.conf).await?;
            let ids = &call.ids;
            k8s_pod::read(&client, &ids.namespace, &ids.pod)
                .await
                .map(Some)
        }
    );
    FirstReads {
        ready,
        existing,
        profile_exists,
        pod,
        ipam,
    }
}

/// What the orchestrator's path starts from, once the first reads are checked.
pub struct CheckedReads {
    /// The endpoint already stored for this container, if any.
    pub existing: Option<WorkloadEndpoint>,
    /// The network's Profile, when it is to be created.
    pub profile: Option<Profile>,
    /// The pod and its namespace (policy type k8s).
    pub pod: Option<PodInfo>,
    pub ipam: IpamView,
}

/// ADD once its first reads are answered: the checks, then the orchestrator's path.
async fn check_then_add(cx: &AddCx<'_>, made: &Record<'_>, reads: FirstReads) -> Result<CniResult> {
    let (call, plan) = (cx.call, &cx.call.plan);
    let conf = &call.conf;
    reads.ready?;
    readiness::wait_for_gates(&conf.readiness_gates).await?;
    let pod = reads.pod?;
    let mut existing = reads.existing?;
    if plan.endpoint_from_pod {
        existing = pod
            .as_ref()
            .and_then(|p| p.endpoint.clone())
            .filter(|w| call.ids.name_matches(&w.metadata.name));
    }
    // Upstream's k8s path checks the dataplane first thing; its cni path only after IPAM.
    // Both are checked here, before anything is allocated.
    conf.check_dataplane()?;
    let profile = match plan.want_profile && !reads.profile_exists? {
        true => Some(endpoint::new_profile(&conf.name, plan.k8s)),
        false => None,
    };
    let answered = CheckedReads {
        existing,
        profile: profile.clone(),
        pod,
        ipam: reads.ipam,
    };
    let mut result = match plan.k8s {
        true => k8s::add(cx, made, answered).await?,
        false => cni::add(cx, made, answered).await?,
    };
    // As upstream, the Profile is created once the pod is networked: a failed ADD never
    // leaves one behind. (If this fails, the rollback undoes the rest; upstream releases
    // the addresses and keeps the endpoint.)
    if let Some(mut p) = profile {
        endpoint::create_profile(&call.ds, &mut p).await?;
    }
    // Calico IPAM sets no gateway; host-local's is meaningless for a /32 interface.
    for ip in &mut result.ips {
        ip.gateway = None;
    }
    Ok(result)
}

/// The IPAM's view (`IpamDriver::read_view`), when the plan has it read in the first round
/// trip (`on`).
async fn read_ipam_view(cx: &AddCx<'_>, on: bool) -> IpamView {
    if !on {
        return IpamView::default();
    }
    // On the Kubernetes datastore the connection (its TLS handshake) is opened before the
    // IPAM takes the host's lock, not while it holds it: other pods' ADDs on this node wait
    // for the lock.
    let ds = &cx.call.ds;
    if let Some(client) = ds.kube_client().filter(|_| ds.is_kubernetes()) {
        client.open().await;
    }
    cx.ipam.read_view().await
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
        return Err(Error::InterfaceNameTemplate {
            ifname: ifname.to_string(),
        });
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
/// the Profile ADD will create as libcalico-go's validator would, before anything is
/// allocated.
fn validate_endpoint_and_profile(wep: &WorkloadEndpoint, profile: Option<&Profile>) -> Result<()> {
    validate::workload_endpoint(wep)?;
    if let Some(p) = profile {
        validate::profile(p)?;
    }
    Ok(())
}

/// Runs the IPAM under `args`, on its `view` and with `hints`. An answer without addresses
/// is refused with `empty` (the rollback releases what the handle may hold).
async fn ipam_add(
    cx: &AddCx<'_>,
    made: &Record<'_>,
    args: &CmdArgs,
    (view, hints): (IpamView, AddHints<'_>),
    empty: EmptyIpamAnswer,
) -> Result<CniResult> {
    let result = cx.ipam.add(args, view, hints).await?;
    info!(ips = ?result.ips.iter().map(|i| i.address.to_string()).collect::<Vec<_>>(), "Got result from IPAM plugin");
    if result.ips.is_empty() {
        made.answered_without_addresses(args);
        return Err(empty.into());
    }
    Ok(result)
}

/// What the dataplane's `build` makes for this endpoint: the pair, named `CNI_IFNAME` in
/// the pod and the endpoint's interface name on the host.
fn veth_request(
    cx: &AddCx<'_>,
    host_veth: &str,
    container_mac: Option<[u8; 6]>,
    families: Option<Families>,
) -> VethRequest {
    VethRequest {
        netns_path: cx.args.netns.clone(),
        ifname: cx.args.ifname.clone(),
        host_veth: host_veth.to_string(),
        mtu: cx.mtu,
        num_queues: cx.call.conf.num_queues(),
        container_mac,
        families,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::NetConf;
    use crate::skel::CniError;
    use crate::support::net::IpNet;

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
