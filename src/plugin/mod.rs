//! The `calico` network plugin (cni-plugin/pkg/plugin): the common prelude of every call
//! (config, node name, identifiers, datastore, ClusterInformation gate) and the CNI entry
//! points; ADD and DEL live in `add.rs` and `del.rs`.

pub mod add;
pub mod check;
pub mod del;
pub mod endpoint;
pub mod endpoint_status;
pub mod gc;
pub mod ipam;
pub mod k8s_pod;
pub mod nodename;
pub mod plan;
pub mod readiness;
pub mod sandbox_lock;
pub mod status;

use tracing::info;

use crate::calico_ipam::call::Known;
use crate::call::client;
use crate::call::cluster_ready::check_datastore_ready;
use crate::config::identifiers::WepIdentifiers;
use crate::config::NetConf;
use crate::dataplane::Families;
use crate::datastore::backend::Backend;
use crate::datastore::kubernetes::client::{KubeClient, KubeSettings};
use crate::datastore::DatastoreError;
use crate::error::{Context, ContextDeadline, Error, Result};
use crate::skel::args::prepend_ignore_unknown;
use crate::skel::{CmdArgs, CniError, CniResult, Plugin};
use ipam::{Driver, IpamKind};
use plan::Plan;

pub struct CalicoPlugin;

impl Plugin for CalicoPlugin {
    fn about(&self) -> String {
        format!("Calico CNI plugin {}", crate::VERSION)
    }

    fn default_result_version(&self) -> &'static str {
        "0.2.0"
    }

    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError> {
        client::block_on(add::cmd_add(args))
            .and_then(|r| r)
            .map_err(|e| {
                tracing::error!(error = %e, "Final result of CNI ADD was an error.");
                CniError::from(e)
            })
    }

    fn del(&self, args: &CmdArgs) -> Result<(), CniError> {
        client::block_on(del::cmd_del(args))
            .and_then(|r| r)
            .map_err(|e| {
                tracing::error!(error = %e, "Final result of CNI DEL was an error.");
                CniError::from(e)
            })
    }

    /// Upstream's CHECK is a dummy; ours compares the previous result with the pod's
    /// interface, the host side and the datastore (`check.rs`).
    fn check(&self, args: &CmdArgs) -> Result<(), CniError> {
        client::block_on(check::cmd_check(args))
            .and_then(|r| r)
            .map_err(|e| {
                tracing::error!(error = %e, "Final result of CNI CHECK was an error.");
                CniError::from(e)
            })
    }

    fn status(&self, args: &CmdArgs) -> Result<(), CniError> {
        client::block_on(status::cmd_status(args)).map_err(CniError::from)?
    }

    fn gc(&self, args: &CmdArgs) -> Result<(), CniError> {
        client::block_on(gc::cmd_gc(args)).map_err(CniError::from)?
    }
}

/// What every `calico` call starts from.
pub struct Call {
    pub conf: NetConf,
    pub ids: WepIdentifiers,
    pub ds: Backend,
    /// The stdin `conf` was parsed from (an in-process calico-ipam given the same bytes uses
    /// `conf` and `ids` instead of parsing them again).
    pub stdin: Vec<u8>,
    pub plan: Plan,
}

impl Call {
    /// The call's IPAM (`ipam::pick`, with the plan's answer to where it runs).
    pub fn ipam(&self) -> Driver<'_, Backend> {
        let known = Known {
            conf: &self.conf,
            ids: &self.ids,
        };
        ipam::pick(self.plan.ipam_in_process, &self.ds, known, &self.stdin)
    }
}

/// The first steps of every call: the config, logging, and the nodename-file gate (ADD
/// waits for the file and DEL goes on without it: `nodename`; they use `load_config`).
pub fn load(args: &CmdArgs) -> Result<NetConf> {
    let conf = load_config(args)?;
    conf.check_nodename_file()?;
    Ok(conf)
}

/// The config, logging and the call's deadline, without the nodename-file gate.
pub fn load_config(args: &CmdArgs) -> Result<NetConf> {
    let conf = NetConf::parse(&args.stdin_data)?;
    crate::logging::init(&conf, "cni-plugin");
    crate::support::deadline::configure(conf.call_timeout_seconds);
    Ok(conf)
}

/// The node name, the identifiers from CNI_ARGS (calico runs with IgnoreUnknown=1
/// prepended, so unknown keys are fine; a bad `IP=` value is not) and the datastore client
/// (whose errors ADD words as `error creating calico client: <e>`, DEL bare, as upstream).
pub async fn connect(args: &CmdArgs, conf: NetConf, verb: Verb) -> Result<Call> {
    let node = conf.node_name();
    connect_as(args, conf, &node, verb).await
}

/// What a call connects for.
pub enum Verb {
    /// ADD, which words the client's errors its own way, and has worked out the families
    /// IPAM will answer with already (`plan::expected_families`: it opens the netlink
    /// handles for them while it connects).
    Add {
        families: Option<Families>,
    },
    Other,
}

/// `connect` for node `node` (empty: a DEL that does not know it, `nodename::for_del`).
pub async fn connect_as(args: &CmdArgs, conf: NetConf, node: &str, verb: Verb) -> Result<Call> {
    let ids = identifiers_on(node, args, &conf)?;
    info!(
        container_id = %args.container_id,
        node = %ids.node,
        orchestrator = %ids.orchestrator,
        namespace = %ids.namespace,
        pod = %ids.pod,
        "calico {}",
        "call"
    );
    let families = match verb {
        Verb::Add { families } => families,
        Verb::Other => plan::expected_families(IpamKind::of(&conf.ipam.ipam_type), &conf, args),
    };
    let ds = match verb {
        Verb::Add { .. } => client::connect_for_add(&conf)
            .await
            .map_err(|e| Error::chain("error creating calico client", e))?,
        Verb::Other => client::connect(&conf).await?,
    };
    let plan = Plan::new(&conf, args, &ids, ds.is_kubernetes(), families);
    tracing::debug!(?plan, "the call's plan");
    Ok(Call {
        conf,
        ids,
        ds,
        stdin: args.stdin_data.clone(),
        plan,
    })
}

/// The call's endpoint identifiers (node, orchestrator, pod or container).
pub fn identifiers(args: &CmdArgs, conf: &NetConf) -> Result<WepIdentifiers> {
    identifiers_on(&conf.node_name(), args, conf)
}

/// `identifiers` on node `node`. Outside Kubernetes, a Mesos task's
/// `projectcalico.org/namespace` label names the endpoint's namespace: for every verb, so
/// that DEL finds the endpoint ADD wrote (upstream applies it at ADD only, and its DEL
/// then leaves that endpoint behind).
fn identifiers_on(node: &str, args: &CmdArgs, conf: &NetConf) -> Result<WepIdentifiers> {
    let mut ids = WepIdentifiers::from_cni_args(
        node,
        &args.container_id,
        &args.ifname,
        &prepend_ignore_unknown(&args.args),
    )?;
    if !ids.is_k8s() {
        if let Some(ns) = conf.mesos_labels().namespace {
            ids.namespace = ns;
        }
    }
    Ok(ids)
}

/// `calico -t`: can we reach the datastore and is it ready? (2 s budget, as upstream)
pub fn test_connection(stdin: &[u8]) -> Result<()> {
    let conf = NetConf::parse(stdin)?;
    client::block_on(async {
        let ds = client::connect(&conf).await?;
        tokio::time::timeout(TEST_CONNECTION_TIMEOUT, check_datastore_ready(&ds))
            .await
            .map_err(|_| Error::chain("error getting ClusterInformation", ContextDeadline))??;
        // With a kubeconfig, the API server must answer too (its version).
        if !conf.kubernetes.kubeconfig.is_empty() {
            let settings = KubeSettings {
                kubeconfig: conf.kubernetes.kubeconfig.clone(),
                ..Default::default()
            };
            let client = KubeClient::new(&settings, TEST_CONNECTION_TIMEOUT)
                .await
                .context("error building K8s client config")?;
            let resp = client
                .get("/version")
                .await
                .context("unable to connect to K8s server")?;
            if !resp.ok() {
                let refused = DatastoreError::Status(resp.status_object().message);
                return Err(Error::chain("unable to connect to K8s server", refused));
            }
        }
        Ok(())
    })?
}

/// `calico -t`'s bound on each check, as upstream.
const TEST_CONNECTION_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);
