//! `calico` DEL (plugin.go cmdDel, k8s.go CmdDelK8s): release the addresses, delete the
//! WorkloadEndpoint and remove the pod's interface. Every step tolerates "already gone", so
//! DEL is idempotent; every step runs even when another failed (the runtime retries DEL, and
//! each retry then has less left to do), and every failure is reported, in one error whose
//! message joins them with "; ". Nothing is removed before the datastore has answered, as
//! upstream: a DEL refused by the ready gate or an unreachable datastore, and (Kubernetes) one
//! whose endpoint cannot be read (any error but "not found": its container ID cannot be
//! checked), touches nothing, so a false DEL is never destructive; the runtime retries it.
//! Under a datastore that does not answer, DEL returns at the call's deadline
//! (`crate::support::deadline`). Without the node name (no nodename file yet at boot,
//! `plugin::nodename`) it does all that needs none, finding the endpoint by container ID.

use tracing::{info, warn};

use crate::call::cluster_ready::check_datastore_ready;
use crate::config::identifiers::WepIdentifiers;
use crate::dataplane::grpc::GrpcDataplane;
use crate::dataplane::link_watch::LinkGoneWatch;
use crate::dataplane::CleanUp;
use crate::datastore::backend::Backend;
use crate::datastore::model::{WorkloadEndpoint, WorkloadEndpointSpec};
use crate::datastore::resources::{decode_resource, delete_resource, get_resource, list_resources};
use crate::datastore::{Datastore, DatastoreError, Key, Kind, ListKind};
use crate::error::{Error, Result};
use crate::ipam::lock::peek_blocks;
use crate::plugin::ipam::IpamDriver;
use crate::plugin::{connect_as, load_config, nodename, Call, Verb};
use crate::skel::CmdArgs;

/// Attempts at the get-then-CAS-delete of a k8s endpoint.
const K8S_DELETE_ATTEMPTS: usize = 6;

/// DEL, top to bottom: what it will do is decided once (`DelPlan`); the first round trip
/// (the ready gate, the k8s endpoint's read, the release's reads); the refusals that touch
/// nothing; then every step, each failure collected in `Failures`; one exit.
pub async fn cmd_del(args: &CmdArgs) -> Result<()> {
    let conf = load_config(args)?;
    // No wait for the nodename file (kubelet DELs many old sandboxes at boot, when it may be
    // missing, and each would wait): without it the node name is unknown, and DEL does
    // everything that does not need it (upstream fails).
    let node = nodename::for_del(&conf);
    let call = connect_as(args, conf, node.as_deref().unwrap_or_default(), Verb::Other).await?;
    let mut plan = DelPlan::decide(&call, args, node.is_some());
    let first_read = first_round_trip(&call, args, &plan).await?;
    let first_read = refuse_a_false_del(&call, &mut plan, first_read)?;
    let failures = match call.plan.k8s {
        true => remove_pod(&call, args, plan, first_read).await,
        false => remove_container(&call, args, plan).await,
    };
    failures.into_result()
}

/// What a DEL will do, decided once from its config and identifiers.
struct DelPlan {
    /// The endpoint's name; `None` when it cannot be built (a segment starting or ending
    /// with `-`: no ADD can have written it, so there is no endpoint to delete, while the
    /// addresses and the interface are still released, which upstream's DEL, failing here
    /// forever, never does) or when the node name is unknown.
    name: Option<String>,
    /// The node name is known; without it the endpoint is looked for by container ID
    /// (`endpoints_of`).
    node_known: bool,
    /// The dataplane options are valid (else nothing of the interface is started, and the
    /// error is reported).
    dataplane: Result<(), crate::config::ConfigError>,
    /// The gRPC dataplane, whose agent's Del replaces the kernel's part.
    grpc: Option<GrpcDataplane>,
    /// With k8s and the kernel's dataplane: the host veth's removal, watched for (subscribed
    /// before the removal starts). Once it is gone, so are the host routes to the pod's
    /// addresses, and they are released while the kernel finishes the teardown
    /// (`dataplane::link_watch`).
    host_veth_gone: Option<LinkGoneWatch>,
}

impl DelPlan {
    fn decide(call: &Call, args: &CmdArgs, node_known: bool) -> DelPlan {
        let name = match call.ids.wep_name() {
            Ok(n) => Some(n),
            Err(_) if !node_known => None,
            Err(e) => {
                warn!(error = %e, "no WorkloadEndpoint name for these identifiers; releasing the rest");
                None
            }
        };
        let dataplane = call.conf.check_dataplane();
        let grpc = match &dataplane {
            Ok(()) => GrpcDataplane::for_conf(&call.conf, 0).ok().flatten(),
            Err(_) => None,
        };
        let host_veth_gone = (dataplane.is_ok() && grpc.is_none())
            .then(|| host_veth_watch(args, &call.ids))
            .flatten();
        DelPlan {
            name,
            node_known,
            dataplane,
            grpc,
            host_veth_gone,
        }
    }

    /// The endpoint's name, with k8s (where it is read in the first round trip).
    fn k8s_name<'a>(&'a self, call: &Call) -> Option<&'a str> {
        self.name.as_deref().filter(|_| call.ids.is_k8s())
    }
}

/// The k8s endpoint's first read, when it was made.
type FirstRead = Option<EndpointRead>;

/// The ready gate and (k8s) the endpoint's first read are independent reads: one round
/// trip. With calico-ipam in-process, the release's first reads (both handles, and the
/// blocks the last ADD on this node assigned from) join it (`Datastore::prefetch`). Nothing
/// is written before the gate has passed.
async fn first_round_trip(call: &Call, args: &CmdArgs, plan: &DelPlan) -> Result<FirstRead> {
    let ahead = release_reads(call, args);
    let (ready, first_read, ()) = tokio::join!(
        check_datastore_ready(&call.ds),
        async {
            match plan.k8s_name(call) {
                Some(n) => Some(read_endpoint(&call.ds, &call.ids.namespace, n).await),
                None => None,
            }
        },
        call.ds.prefetch(&ahead)
    );
    ready?;
    Ok(first_read)
}

/// With k8s, nothing is touched when the dataplane options are wrong (a configuration
/// error), or, upstream's guard against a false DEL, when the endpoint cannot be read (but
/// is not missing): its container ID is then unchecked. A retried DEL does the work.
fn refuse_a_false_del(call: &Call, plan: &mut DelPlan, first_read: FirstRead) -> Result<FirstRead> {
    if !call.plan.k8s {
        return Ok(first_read);
    }
    std::mem::replace(&mut plan.dataplane, Ok(()))?;
    match first_read {
        Some(Err(e)) if !e.is_not_found() => {
            warn!(error = %e, "the endpoint cannot be read: nothing is removed (a retried DEL does it)");
            Err(e.into())
        }
        other => Ok(other),
    }
}

/// A Kubernetes pod's DEL. The interface's removal starts (one RTM_DELLINK whose teardown
/// takes ~15 ms, on its own thread); the endpoint's deletion and the release (once the
/// interface's host side is gone: a new pod cannot get an address while the old host route
/// exists) run together, one round trip for both. Either may land without the other (a
/// failure, a SIGKILL in between); the runtime's retried DEL then finds what is left: the
/// endpoint by its name, the addresses by their handle, which is deleted only after its
/// blocks have given them up (`decrement_handle`), so it always leads to them.
async fn remove_pod(call: &Call, args: &CmdArgs, plan: DelPlan, first_read: FirstRead) -> Failures {
    let ids = &call.ids;
    let ipam = call.ipam();
    let k8s_name = plan.k8s_name(call).map(str::to_string);
    let mut teardown = Teardown::start(true, plan.grpc, args);
    let endpoint = async {
        match (k8s_name, first_read) {
            (Some(name), Some(first)) => {
                delete_k8s_endpoint(&call.ds, &ids.namespace, &name, &ids.container_id, first).await
            }
            _ if !plan.node_known => delete_endpoints_of(&call.ds, ids).await,
            _ => Ok(()),
        }
    };
    let mut failures = Failures::default();
    let mut released = Failures::default();
    let (endpoint, ()) = tokio::join!(
        endpoint,
        release_once_torn_down(
            &ipam,
            args,
            &mut teardown,
            plan.host_veth_gone,
            &mut released
        )
    );
    failures.add(endpoint);
    failures.0.extend(released.0);
    failures
}

/// Any other container's DEL: the interface's removal starts, then the release, the
/// endpoint's deletion, and the wait for the removal, one after the other.
async fn remove_container(call: &Call, args: &CmdArgs, plan: DelPlan) -> Failures {
    let ids = &call.ids;
    let mut failures = Failures::default();
    let mut teardown = Teardown::start(plan.dataplane.is_ok(), plan.grpc, args);
    failures.add(call.ipam().del(args).await);
    if let Some(name) = &plan.name {
        failures.add(delete_endpoint(&call.ds, &ids.namespace, name).await);
    } else if !plan.node_known {
        failures.add(delete_endpoints_of(&call.ds, ids).await);
    }
    if let Err(e) = plan.dataplane {
        failures.push(e.into());
    }
    failures.add(teardown.finish().await);
    failures
}

/// The reads a k8s DEL's in-process calico-ipam starts with: its two handles and the blocks
/// the IPAM lock file names (where the last ADD on this node assigned from, and any block
/// with a pending write for one of the handles). Without a netns (the runtime's repeated
/// DEL of a sandbox already torn down, whose handle is usually gone) only the handles: the
/// blocks are read, one round trip later, only if a handle leads to them.
fn release_reads(call: &Call, args: &CmdArgs) -> Vec<Key> {
    if !(call.plan.k8s && call.plan.ipam_in_process) {
        return Vec::new();
    }
    let handles = [
        call.ids.handle_id(&call.conf.name),
        call.ids.legacy_handle_id(),
    ];
    let blocks = match args.netns.is_empty() {
        true => Vec::new(),
        false => peek_blocks(call.conf.ipam_lock_file(), &handles),
    };
    handles
        .into_iter()
        .map(|id| Key::Handle { id })
        .chain(blocks.into_iter().map(|cidr| Key::Block { cidr }))
        .collect()
}

/// With k8s, the addresses are released once the host side of the interface is gone: the
/// host veth's removal was notified (the release then runs while the kernel finishes), or
/// the whole removal finished. A removal that failed before the host veth was seen gone
/// keeps them (a retried DEL releases them), the gRPC agent's Del included, as upstream:
/// an address is never handed out while an interface may still hold it.
async fn release_once_torn_down<I: IpamDriver>(
    ipam: &I,
    args: &CmdArgs,
    teardown: &mut Teardown,
    host_veth_gone: Option<LinkGoneWatch>,
    failures: &mut Failures,
) {
    let finished = teardown.finish();
    tokio::pin!(finished);
    // The notification is asked first: when the removal has also finished by the time DEL
    // gets here (its datastore steps took longer than the kernel's teardown), the host veth
    // is known gone all the same, and the outcome is the same whichever is seen first.
    let torn = match host_veth_gone {
        Some(watch) => tokio::select! {
            biased;
            () = watch.gone() => None,
            torn = &mut finished => Some(torn),
        },
        None => Some((&mut finished).await),
    };
    match torn {
        Some(Ok(())) => failures.add(ipam.del(args).await),
        Some(Err(e)) => {
            warn!("the pod's addresses are kept until its interface is gone (a retried DEL releases them)");
            failures.push(e);
        }
        None => {
            info!("the host veth is gone; releasing the pod's addresses while the kernel finishes its removal");
            let (released, torn) = tokio::join!(ipam.del(args), &mut finished);
            failures.add(released);
            failures.add(torn);
        }
    }
}

/// Deletes a (non-Kubernetes) endpoint; one that is already gone is success.
async fn delete_endpoint<D: crate::datastore::Datastore>(
    ds: &D,
    namespace: &str,
    name: &str,
) -> Result<()> {
    match delete_resource(ds, Kind::WorkloadEndpoint, Some(namespace), name, None).await {
        Ok(()) => info!(name, "deleted endpoint"),
        Err(e) if e.is_not_found() => {
            info!(name, "Endpoint object does not exist, no need to clean up.")
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// DEL without the node name: deletes this container's endpoints found by `endpoints_of`
/// (none found: nothing to delete), each as a DEL that knows its name would.
async fn delete_endpoints_of(ds: &Backend, ids: &WepIdentifiers) -> Result<()> {
    let found = endpoints_of(ds, ids).await?;
    if found.is_empty() {
        info!(
            container_id = %ids.container_id,
            "no endpoint of this container found (the node name is unknown); none to delete"
        );
    }
    for wep in found {
        let name = wep.metadata.name.clone();
        info!(%name, "found this container's endpoint without the node name");
        if ids.is_k8s() {
            delete_k8s_endpoint(ds, &ids.namespace, &name, &ids.container_id, Ok(wep)).await?;
        } else {
            delete_endpoint(ds, &ids.namespace, &name).await?;
        }
    }
    Ok(())
}

/// This container's endpoints, found without the node name (the first segment of their
/// names). On etcd: the namespace's endpoints listed (one read; a DEL that knows the node
/// reads one key instead) and those of this orchestrator, container ID, interface and (k8s)
/// pod kept. On the Kubernetes datastore the endpoint is the pod's, read by namespace and
/// pod alone; `delete_k8s_endpoint` then keeps it if it belongs to another container.
async fn endpoints_of(ds: &Backend, ids: &WepIdentifiers) -> Result<Vec<WorkloadEndpoint>> {
    match ds {
        Backend::Kubernetes(k) if ids.is_k8s() => {
            match k.endpoint_of_pod(&ids.namespace, &ids.pod).await? {
                Some(kv) => Ok(vec![decode_resource(Kind::WorkloadEndpoint, &kv)?]),
                None => Ok(Vec::new()),
            }
        }
        // The Kubernetes datastore holds pods' endpoints only.
        Backend::Kubernetes(_) => Ok(Vec::new()),
        Backend::Etcd(_) => {
            let all: Vec<WorkloadEndpoint> = list_resources(
                ds,
                &ListKind::Resources {
                    kind: Kind::WorkloadEndpoint,
                    namespace: Some(ids.namespace.clone()),
                    name_prefix: None,
                },
            )
            .await?;
            Ok(all.into_iter().filter(|w| is_of(w, ids)).collect())
        }
    }
}

/// Whether `wep` is the endpoint these identifiers name, whatever its node.
fn is_of(wep: &WorkloadEndpoint, ids: &WepIdentifiers) -> bool {
    let s = &wep.spec;
    s.orchestrator == ids.orchestrator
        && s.container_id == ids.container_id
        && s.endpoint == ids.endpoint
        && (!ids.is_k8s() || s.pod == ids.pod)
}

/// Every failure of a DEL, in the order its steps ran.
#[derive(Default)]
struct Failures(Vec<Error>);

impl Failures {
    fn push(&mut self, e: Error) {
        warn!(error = %e, "a step of DEL failed; going on with the others");
        self.0.push(e);
    }

    fn add(&mut self, r: Result<()>) {
        if let Err(e) = r {
            self.push(e);
        }
    }

    /// One failure as it is; several as one error naming them all (`Error::List`: joined
    /// with "; ", code 11 when one of them is the call's deadline, else the first one's).
    fn into_result(mut self) -> Result<()> {
        match self.0.len() {
            0 => Ok(()),
            1 => Err(self.0.remove(0)),
            _ => Err(Error::List(self.0)),
        }
    }
}

/// The pod interface's removal (`dataplane::CleanUp`), awaited once.
struct Teardown(Option<CleanUp>);

impl Teardown {
    /// Starts the removal (nothing when the dataplane options are wrong).
    fn start(dataplane_ok: bool, grpc: Option<GrpcDataplane>, args: &CmdArgs) -> Teardown {
        Teardown(dataplane_ok.then(|| CleanUp::start(grpc, &args.netns, &args.ifname)))
    }

    /// Waits for the removal (once) and gives its outcome.
    async fn finish(&mut self) -> Result<()> {
        match self.0.take() {
            None => Ok(()),
            Some(c) => Ok(c.finish().await?),
        }
    }
}

/// With k8s, a watch for the removal of the pod's host-side veth (`None` when it cannot be
/// made: DEL then waits for the whole removal, as before).
fn host_veth_watch(args: &CmdArgs, ids: &WepIdentifiers) -> Option<LinkGoneWatch> {
    if args.netns.is_empty() || !ids.is_k8s() {
        return None;
    }
    match LinkGoneWatch::subscribe(&ids.host_veth_name()) {
        Ok(w) => Some(w),
        Err(e) => {
            warn!(error = %e, "cannot watch the host veth's removal; waiting for the whole teardown");
            None
        }
    }
}

type EndpointRead = std::result::Result<WorkloadEndpoint, DatastoreError>;

async fn read_endpoint<D: crate::datastore::Datastore>(
    ds: &D,
    namespace: &str,
    name: &str,
) -> EndpointRead {
    get_resource::<D, WorkloadEndpointSpec>(ds, Kind::WorkloadEndpoint, Some(namespace), name).await
}

/// Deletes the pod's endpoint unless it now belongs to a newer sandbox (another container
/// ID), compare-and-swapping on the revision read.
async fn delete_k8s_endpoint<D: crate::datastore::Datastore>(
    ds: &D,
    namespace: &str,
    name: &str,
    container_id: &str,
    first_read: EndpointRead,
) -> Result<()> {
    let mut first_read = Some(first_read);
    let mut attempt = 1;
    loop {
        let read = match first_read.take() {
            Some(r) => r,
            None => read_endpoint(ds, namespace, name).await,
        };
        let wep = match read {
            Ok(w) => w,
            Err(e) if e.is_not_found() => {
                info!(name, "Endpoint object does not exist, no need to clean up.");
                return Ok(());
            }
            Err(e) => return Err(e.into()),
        };
        if !wep.spec.container_id.is_empty() && wep.spec.container_id != container_id {
            info!(
                name,
                endpoint_container = %wep.spec.container_id,
                "endpoint belongs to another container; keeping it"
            );
            return Ok(());
        }
        match delete_resource(
            ds,
            Kind::WorkloadEndpoint,
            Some(namespace),
            name,
            Some(&wep.metadata.resource_version),
        )
        .await
        {
            Ok(()) => {
                info!(name, "deleted endpoint");
                return Ok(());
            }
            Err(e) if e.is_not_found() => return Ok(()),
            Err(e) if e.is_conflict() && attempt < K8S_DELETE_ATTEMPTS => attempt += 1,
            Err(e) if e.is_conflict() => {
                let context =
                    "error deleting endpoint: endpoint was modified before it could be deleted";
                return Err(Error::chain(context, e));
            }
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::skel::error::CODE_TRY_AGAIN_LATER;
    use crate::skel::CniError;

    use crate::dataplane::{CleanUp, DataplaneError, DelLinkError};
    use crate::plugin::ipam::fake::FakeIpam;

    /// `release_once_torn_down` with a removal that ends with `torn` (as the gRPC agent's
    /// or the kernel's would): what IPAM was asked, and the failures.
    fn release_after(torn: Result<(), DataplaneError>) -> (Vec<&'static str>, Vec<String>) {
        let ipam = FakeIpam::default();
        let args = CmdArgs::default();
        let mut failures = Failures::default();
        crate::call::client::block_on(async {
            let mut teardown = Teardown(Some(CleanUp::Grpc(tokio::spawn(async move { torn }))));
            release_once_torn_down(&ipam, &args, &mut teardown, None, &mut failures).await;
            assert!(teardown.0.is_none(), "the removal is awaited once");
        })
        .unwrap();
        let log = ipam.log.borrow().clone();
        (log, failures.0.iter().map(ToString::to_string).collect())
    }

    #[test]
    fn addresses_are_released_once_the_interface_is_gone() {
        assert_eq!(release_after(Ok(())), (vec!["ipam del"], vec![]));
    }

    /// A removal that failed keeps the addresses (a host route may still lead to the old
    /// pod); a retried DEL releases them.
    #[test]
    fn a_failed_removal_keeps_the_addresses() {
        let e = DataplaneError::CleanUpLink(DelLinkError::Kernel(nix::errno::Errno::EBUSY));
        let (log, failures) = release_after(Err(e));
        assert!(log.is_empty(), "{log:?}");
        assert_eq!(
            failures,
            ["failed to clean up workload's veth inside netns: device or resource busy"]
        );
    }

    /// The gRPC agent's failed Del is reported and keeps the addresses too, as upstream.
    #[test]
    fn a_failed_grpc_del_keeps_the_addresses() {
        let e = DataplaneError::GrpcReply("no such interface".into());
        let (log, failures) = release_after(Err(e));
        assert!(log.is_empty(), "{log:?}");
        assert_eq!(failures, ["grpc dataplane error: no such interface"]);
    }

    /// A delete that keeps losing the compare-and-swap is tried K8S_DELETE_ATTEMPTS times,
    /// then fails with the last conflict as its cause; one attempt fewer lost, it deletes.
    #[test]
    fn an_endpoint_delete_gives_up_after_its_last_conflict() {
        use crate::datastore::memory::{Fault, KeyClass, MemoryDatastore};
        use crate::datastore::resources::create_resource;
        let run = |conflicts: u64| {
            let ds = MemoryDatastore::new();
            crate::call::client::block_on(async {
                let mut wep = WorkloadEndpoint::default();
                wep.metadata.name = "node1-k8s-pod1-eth0".into();
                wep.metadata.namespace = "ns1".into();
                wep.spec.container_id = "cid1".into();
                create_resource(&ds, Kind::WorkloadEndpoint, &mut wep).await?;
                for n in 1..=conflicts {
                    let on_endpoints = KeyClass::Resource(Kind::WorkloadEndpoint);
                    ds.inject(Fault::on(on_endpoints, Fault::ConflictOnWrite(n + 1)));
                }
                let first = read_endpoint(&ds, "ns1", "node1-k8s-pod1-eth0").await;
                let deleted =
                    delete_k8s_endpoint(&ds, "ns1", "node1-k8s-pod1-eth0", "cid1", first).await;
                let left = read_endpoint(&ds, "ns1", "node1-k8s-pod1-eth0").await;
                Ok::<_, Error>((deleted, left.is_ok(), ds.pending_faults().is_empty()))
            })
            .unwrap()
            .unwrap()
        };
        let attempts = K8S_DELETE_ATTEMPTS as u64;
        let (deleted, left, all_hit) = run(attempts);
        let e = deleted.unwrap_err();
        assert!(
            e.to_string().starts_with(
                "error deleting endpoint: endpoint was modified before it could be deleted: \
                 update conflict: "
            ),
            "{e}"
        );
        assert!(
            matches!(e, Error::Chain { ref source, .. } if matches!(**source, Error::Datastore(DatastoreError::Conflict(_))))
        );
        assert!(left && all_hit);
        let (deleted, left, all_hit) = run(attempts - 1);
        assert!(deleted.is_ok() && !left && all_hit, "{deleted:?}");
    }

    /// Without the node name, an endpoint is this call's by its spec, whatever its node.
    #[test]
    fn endpoints_are_matched_without_the_node() {
        let ids = WepIdentifiers::new("", "cid1", "eth0", "ns1", "pod1", "");
        let wep = |f: &dyn Fn(&mut WorkloadEndpointSpec)| {
            let mut w = WorkloadEndpoint {
                spec: WorkloadEndpointSpec {
                    orchestrator: "k8s".into(),
                    node: "some-node".into(),
                    container_id: "cid1".into(),
                    pod: "pod1".into(),
                    endpoint: "eth0".into(),
                    ..Default::default()
                },
                ..Default::default()
            };
            f(&mut w.spec);
            w
        };
        assert!(is_of(&wep(&|_| {}), &ids));
        assert!(!is_of(&wep(&|s| s.container_id = "cid2".into()), &ids));
        assert!(!is_of(&wep(&|s| s.container_id.clear()), &ids));
        assert!(!is_of(&wep(&|s| s.pod = "pod2".into()), &ids));
        assert!(!is_of(&wep(&|s| s.endpoint = "net1".into()), &ids));
        assert!(!is_of(&wep(&|s| s.orchestrator = "cni".into()), &ids));
        let cni = WepIdentifiers::new("", "cid1", "eth0", "", "", "");
        assert!(is_of(
            &wep(&|s| {
                s.orchestrator = "cni".into();
                s.pod.clear();
            }),
            &cni
        ));
    }

    #[test]
    fn failures_are_all_reported() {
        assert!(Failures::default().into_result().is_ok());
        let one = Failures(vec![Error::msg("error deleting endpoint: boom")]);
        assert_eq!(
            one.into_result().unwrap_err().to_string(),
            "error deleting endpoint: boom"
        );
        let expired =
            crate::support::deadline::expired("waiting for etcd (get /calico/ipam/v2/handle/h)");
        let two = Failures(vec![
            Error::Datastore(DatastoreError::Deadline(expired.clone())),
            Error::msg("failed to clean up workload's veth inside netns: boom"),
        ]);
        let e = CniError::from(two.into_result().unwrap_err());
        assert_eq!(e.code, CODE_TRY_AGAIN_LATER);
        assert_eq!(
            e.msg,
            format!("{expired}; failed to clean up workload's veth inside netns: boom")
        );
        let plain = Failures(vec![Error::msg("a"), Error::msg("b")]);
        let e = CniError::from(plain.into_result().unwrap_err());
        assert_eq!((e.code, e.msg.as_str()), (999, "a; b"));
    }
}
