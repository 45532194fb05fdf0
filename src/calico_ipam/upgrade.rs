//! `calico-ipam -upgrade`: the host-local → Calico IPAM migration of v3.32.1
//! (cni-plugin/pkg/upgrade/migrate.go, run by ipam_plugin.go's `-upgrade` flag from the
//! `upgrade-ipam` init container). Kubernetes datastore only; no stdin, no CNI_* variables:
//! the node is `KUBERNETES_NODE_NAME`, the API server comes from the environment as
//! libcalico-go's `apiconfig.LoadClientConfig("")` reads it.
//!
//! Steps, in upstream's order: stop when host-local's data dir is absent; give the node an
//! IPIP tunnel address (the first address of its IPv4 podCIDR, through AssignIP, stored as
//! the node annotation `projectcalico.org/IPv4IPIPTunnelAddr`, which is the Calico Node's
//! `spec.bgp.ipv4IPIPTunnelAddr` on the Kubernetes datastore); remove an empty data dir and
//! stop; else set ClusterInformation `datastoreReady: false`, delete the CNI binaries, wait,
//! take host-local's lock, AssignIP each allocation file's address to its pod (handle
//! `k8s-pod-network.<containerID>`) and delete the file; set `datastoreReady: true`; remove
//! the dir. Any failure makes the whole migration start again a second later, for ever.
//!
//! Host paths are upstream's constants, kept in [`Options`] (whose `Default` is upstream's);
//! the binary lets tests move them with the `CALICO_IPAM_UPGRADE_TEST_*` variables.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::Method;
use nix::fcntl::{Flock, FlockArg};
use serde_json::Value;
use tracing::{error, info, warn};

use crate::config::NetConf;
use crate::datastore::backend;
use crate::datastore::kubernetes::api_error;
use crate::datastore::kubernetes::client::KubeClient;
use crate::datastore::model::ClusterInformation;
use crate::datastore::resources::{get_resource, update_resource};
use crate::datastore::settings::DatastoreSettings;
use crate::datastore::{Datastore, DatastoreError, Key, Kind};
use crate::ipam::allocator::{Ipam, IpamError};
use crate::support::gocompat::{errno_text, io_error_text, path_error};
use crate::support::net::ParseIpNetError;

/// host-local's data dir for Calico's network (`ipAllocPath`).
pub const HOST_LOCAL_DIR: &str = "/var/lib/cni/networks/k8s-pod-network";
/// The binaries deleted so that no CNI call runs during the migration (`binariesToDisable`).
pub const BINARIES_TO_DISABLE: [&str; 2] =
    ["/host/opt/cni/bin/calico", "/host/opt/cni/bin/host-local"];
/// Test-only override of [`HOST_LOCAL_DIR`].
pub const ENV_TEST_HOST_LOCAL_DIR: &str = "CALICO_IPAM_UPGRADE_TEST_HOST_LOCAL_DIR";
/// Test-only override of [`BINARIES_TO_DISABLE`]: `:`-separated paths (empty: none).
pub const ENV_TEST_BINARIES: &str = "CALICO_IPAM_UPGRADE_TEST_BINARIES_TO_DISABLE";
/// The node the migration works for.
pub const ENV_NODE_NAME: &str = "KUBERNETES_NODE_NAME";

/// The network name in the handles of migrated pods (fixed, whatever the CNI config says).
const NETWORK_NAME: &str = "k8s-pod-network";
const IPIP_ANNOTATION: &str = "projectcalico.org/IPv4IPIPTunnelAddr";
const ATTR_NODE: &str = "node";
const ATTR_POD: &str = "pod";
const ATTR_NAMESPACE: &str = "namespace";
const ATTR_TYPE: &str = "type";
const ATTR_TYPE_IPIP: &str = "ipipTunnelAddress";
/// Upstream's bound on each of its conflict-retry loops (Node, ClusterInformation).
const CONFLICT_RETRIES: usize = 5;

/// Where the migration works and how long it waits; `Default` is upstream's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    pub host_local_dir: PathBuf,
    pub binaries_to_disable: Vec<PathBuf>,
    /// The pause after deleting the binaries (upstream: 5 s).
    pub settle: Duration,
    /// The pause after an update conflict (1 s).
    pub conflict_backoff: Duration,
    /// The pause before the migration starts again after a failure (1 s).
    pub retry_interval: Duration,
    /// apiconfig's `USE_POD_CIDR`: the Calico Node's IPIP tunnel address is then derived
    /// from the podCIDR instead of read from the annotation.
    pub use_pod_cidr: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            host_local_dir: PathBuf::from(HOST_LOCAL_DIR),
            binaries_to_disable: BINARIES_TO_DISABLE.iter().map(PathBuf::from).collect(),
            settle: Duration::from_secs(5),
            conflict_backoff: Duration::from_secs(1),
            retry_interval: Duration::from_secs(1),
            use_pod_cidr: false,
        }
    }
}

impl Options {
    /// The defaults with the test-only path overrides applied.
    pub fn with_test_overrides(env: &dyn Fn(&str) -> Option<String>) -> Options {
        let mut o = Options::default();
        if let Some(dir) = env(ENV_TEST_HOST_LOCAL_DIR) {
            o.host_local_dir = PathBuf::from(dir);
        }
        if let Some(list) = env(ENV_TEST_BINARIES) {
            o.binaries_to_disable = list
                .split(':')
                .filter(|p| !p.is_empty())
                .map(PathBuf::from)
                .collect();
        }
        o
    }
}

/// A failed migration step, with upstream's text; the cause under it kept as its source.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("failed to open host-local IPAM data dir dir: {0}")]
    OpenDataDir(#[source] PathError),
    /// The empty data dir could not be removed (upstream returns the bare error).
    #[error("{0}")]
    RemoveEmptyDataDir(#[source] PathError),
    #[error("failed to read host-local IPAM data dir names: {0}")]
    ReadDataDirNames(#[source] PathError),
    #[error("failed to remove binary {}: {source}", .source.path.display())]
    RemoveBinary {
        #[source]
        source: PathError,
    },
    #[error("failed to initialize host-local IPAM: {0}")]
    InitHostLocal(#[source] DiskError),
    #[error("failed to acquire lock on host-local IPAM: {0}")]
    LockHostLocal(#[source] DiskError),
    /// Every attempt to disable the cluster conflicted: there is nothing to re-enable.
    #[error("failed to re-enable cluster: ClusterInformation update conflicted 5 times")]
    ReenableConflicted,
    #[error("failed to re-enable cluster: {0}")]
    Reenable(#[source] DatastoreError),
    #[error("failed to get calico node resource: {0}")]
    GetCalicoNode(#[source] DatastoreError),
    /// The Calico Node's tunnel address, derived from a podCIDR that does not parse.
    #[error("failed to get calico node resource: {0}")]
    CalicoNodeCidr(#[source] ParseIpNetError),
    #[error("failed to get k8s node resource: {0}")]
    GetK8sNode(#[source] DatastoreError),
    /// The API server refused the read (its message).
    #[error("failed to get k8s node resource: {0}")]
    GetK8sNodeRefused(String),
    #[error("PodCIDR {cidr} did not parse successfully: {source}")]
    PodCidr {
        cidr: String,
        #[source]
        source: ParseIpNetError,
    },
    #[error("cannot pick an IPv4 tunnel address from the given CIDR: {0}")]
    NotIpv4PodCidr(String),
    #[error("failed to get add IPIP tunnel addr {ip}: {source}")]
    AssignTunnel {
        ip: Ipv4Addr,
        #[source]
        source: IpamError,
    },
    #[error("failed to update node: {0}")]
    UpdateNode(#[source] DatastoreError),
    #[error("failed to fetch cluster information: {0}")]
    FetchClusterInfo(#[source] DatastoreError),
    #[error("failed to disable cluster: {0}")]
    DisableCluster(#[source] DatastoreError),
    #[error("failed to list pods: {0}")]
    ListPods(#[source] DatastoreError),
    /// The API server refused the list (its message).
    #[error("failed to list pods: {0}")]
    ListPodsRefused(String),
    #[error("failed to read path {}: {source}", .source.path.display())]
    ReadDataDir {
        #[source]
        source: PathError,
    },
    #[error("failed to remove file {}: {source}", .source.path.display())]
    RemoveFile {
        #[source]
        source: PathError,
    },
    #[error("failed to parse IP {name}: {source}")]
    ParseIp {
        name: String,
        #[source]
        source: ParseIpNetError,
    },
    #[error("failed to read file {}: {source}", .source.path.display())]
    ReadFile {
        #[source]
        source: PathError,
    },
    #[error("failed to assign IP to calico backend: {0}")]
    Assign(#[source] IpamError),
}

/// Go's `*os.PathError`: `<op> <path>: <errno text>`.
#[derive(Debug, thiserror::Error)]
#[error("{}", path_error(.op, .path, .source))]
pub struct PathError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: io::Error,
}

impl PathError {
    fn new(op: &'static str, path: &Path, source: io::Error) -> PathError {
        PathError {
            op,
            path: path.to_path_buf(),
            source,
        }
    }
}

/// host-local's lock file (`disk.New`, `FileLock`), as Go words its failures.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error(transparent)]
    Path(#[from] PathError),
    /// Opening the lock file (upstream prints the bare errno text).
    #[error("{}", io_error_text(.0))]
    Open(#[source] io::Error),
    /// `flock` failed.
    #[error("{}", errno_text(*.0 as i32))]
    Flock(#[source] nix::errno::Errno),
}

type Result<T> = std::result::Result<T, MigrateError>;

// ------------------------------------------------------------------ the -upgrade flag

/// `calico-ipam -upgrade` (ipam_plugin.go `Main`): returns the exit code. Logs go to stderr
/// at info. A missing node name or an unusable API configuration is fatal (exit 1);
/// otherwise the migration is retried every second until it succeeds (exit 0).
pub fn run(opts: Options, env: &dyn Fn(&str) -> Option<String>) -> u8 {
    crate::logging::init(&NetConf::default(), "ipam");
    info!("migrating from host-local to calico-ipam...");
    let nodename = env(ENV_NODE_NAME).unwrap_or_default();
    if nodename.is_empty() {
        // logrus.Fatal: the line, then exit 1.
        error!("KUBERNETES_NODE_NAME not specified, refusing to migrate...");
        return 1;
    }
    let Ok((settings, use_pod_cidr)) = api_settings(env) else {
        error!(node = %nodename, "failed to load api client config");
        return 1;
    };
    let opts = Options {
        use_pod_cidr,
        ..opts
    };
    let outcome = crate::call::client::block_on(async {
        let Ok(ds) = backend::connect(&settings).await else {
            error!(node = %nodename, "failed to initialize api client");
            return false;
        };
        let Ok(kube) = ds.plugin_kube_client(&NetConf::default()).await else {
            error!(node = %nodename, "failed to initialize api client");
            return false;
        };
        loop {
            match migrate(&ds, &kube, &nodename, &opts).await {
                Ok(()) => return true,
                Err(e) => {
                    error!(node = %nodename, error = %e, "failed to migrate ipam, retrying...");
                    tokio::time::sleep(opts.retry_interval).await;
                }
            }
        }
    });
    match outcome {
        Ok(true) => {
            info!(node = %nodename, "migration from host-local to calico-ipam complete");
            0
        }
        Ok(false) => 1,
        Err(e) => {
            error!(node = %nodename, "{e}");
            1
        }
    }
}

/// The API client configuration from the environment (`apiconfig.LoadClientConfig("")`,
/// with its defaults: `$HOME/.kube/config` when the environment selects the Kubernetes
/// datastore and names no API server), the datastore type then forced to Kubernetes as
/// upstream forces it; and `USE_POD_CIDR`. As envconfig, `CALICO_<NAME>` beats `<NAME>`; a
/// set but unparsable boolean or number fails the load.
pub fn api_settings(
    env: &dyn Fn(&str) -> Option<String>,
) -> std::result::Result<(DatastoreSettings, bool), String> {
    let mut s = DatastoreSettings::load(&NetConf::default(), env).map_err(|e| e.to_string())?;
    s.datastore_type = "kubernetes".into();
    let use_pod_cidr = s.use_pod_cidr;
    Ok((s, use_pod_cidr))
}

// ------------------------------------------------------------------ the migration

/// One migration attempt (`upgrade.Migrate`).
pub async fn migrate<D: Datastore>(
    ds: &D,
    kube: &KubeClient,
    nodename: &str,
    opts: &Options,
) -> Result<()> {
    let dir = opts.host_local_dir.as_path();
    info!("checking host-local IPAM data dir existence...");
    if let Err(e) = fs::metadata(dir) {
        if e.kind() == io::ErrorKind::NotFound {
            info!("host-local IPAM data dir not found; no migration necessary, successfully exiting...");
            return Ok(());
        }
    }

    assign_ipip_tunnel_address(ds, kube, nodename, opts).await?;

    info!("checking if host-local IPAM data dir is empty...");
    File::open(dir).map_err(|e| MigrateError::OpenDataDir(PathError::new("open", dir, e)))?;
    let first = fs::read_dir(dir).and_then(|mut entries| entries.next().transpose());
    match first {
        Ok(Some(_)) => {}
        Ok(None) => {
            info!("host-local IPAM data dir empty; no migration necessary...");
            info!("removing host-local IPAM data directory...");
            if let Err(e) = go_remove(dir) {
                let e = PathError::new("remove", dir, e);
                error!(error = %e, "failed to remove host-local IPAM data dir directory");
                return Err(MigrateError::RemoveEmptyDataDir(e));
            }
            info!("successfully removed host-local IPAM data directory!");
            return Ok(());
        }
        Err(e) => {
            return Err(MigrateError::ReadDataDirNames(PathError::new(
                "readdirent",
                dir,
                e,
            )))
        }
    }
    info!("host-local IPAM data dir is not empty, migrating...");

    let mut cluster_info = disable_cluster(ds, opts).await?;

    info!("removing cni binaries...");
    for binary in &opts.binaries_to_disable {
        match go_remove(binary) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(MigrateError::RemoveBinary {
                    source: PathError::new("remove", binary, e),
                })
            }
            _ => {}
        }
        info!(binary = %binary.display(), "successfully removed cni binary!");
    }
    tokio::time::sleep(opts.settle).await;

    info!("acquiring lock on host-local IPAM");
    let mut lock = HostLocalLock::open(dir).map_err(MigrateError::InitHostLocal)?;
    lock.lock().map_err(MigrateError::LockHostLocal)?;
    info!("successfully acquired lock on host-local IPAM");
    // Upstream's `defer Unlock()`: whichever way this function returns from here on.
    let mut lock = DeferredUnlock(lock);

    let pods = pods_by_ip(kube, nodename).await?;
    migrate_files(ds, nodename, dir, &pods).await?;

    match lock.0.unlock() {
        Ok(()) => info!("successfully released lock on host-local backend!"),
        Err(e) => error!(error = %e, "failed to release lock on host local backend"),
    }

    // Re-enabled whatever happened to other nodes, as upstream.
    info!("setting Calico datastore readiness to true...");
    // Upstream dereferences a nil ClusterInformation here (a crash) when all five disable
    // attempts conflicted; this attempt fails instead and the next one starts over.
    let Some(ci) = cluster_info.as_mut() else {
        return Err(MigrateError::ReenableConflicted);
    };
    ci.spec.datastore_ready = Some(true);
    update_resource(ds, Kind::ClusterInformation, ci)
        .await
        .map_err(MigrateError::Reenable)?;
    info!("successfully set Calico datastore readiness to true!");

    info!("removing host-local IPAM data directory");
    match fs::remove_dir_all(dir) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            let e = path_error("unlinkat", dir, &e);
            error!(error = %e, "failed to remove host-local IPAM data dir directory");
        }
        _ => {}
    }
    info!("successfully removed host-local IPAM data directory!");
    Ok(())
}

/// The IPIP tunnel address step: only when the Calico Node has none.
async fn assign_ipip_tunnel_address<D: Datastore>(
    ds: &D,
    kube: &KubeClient,
    nodename: &str,
    opts: &Options,
) -> Result<()> {
    info!("retrieving node for IPIP tunnel address");
    let node = get_calico_node(kube, nodename).await?;
    let current =
        calico_ipip_tunnel_addr(&node, opts.use_pod_cidr).map_err(MigrateError::CalicoNodeCidr)?;
    if !current.is_empty() {
        return Ok(());
    }
    info!("IPIP tunnel address not found, assigning...");

    let resp = kube
        .get(&node_path(nodename))
        .await
        .map_err(MigrateError::GetK8sNode)?;
    if !resp.ok() {
        return Err(MigrateError::GetK8sNodeRefused(
            resp.status_object().message,
        ));
    }
    let k8s_node = resp.json().map_err(MigrateError::GetK8sNode)?;
    let pod_cidr = k8s_node
        .pointer("/spec/podCIDR")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let cidr = parse_go_cidr(pod_cidr).map_err(|source| MigrateError::PodCidr {
        cidr: pod_cidr.to_string(),
        source,
    })?;
    if !cidr.network_is_v4 {
        info!("IPv6 podCIDR - no need to migrate IPIP address");
        return Ok(());
    }
    let tunnel = match cidr.ip {
        IpAddr::V4(v4) => first_address(v4),
        IpAddr::V6(_) => return Err(MigrateError::NotIpv4PodCidr(pod_cidr.to_string())),
    };

    let handle = format!("ipip-tunnel-addr-{nodename}");
    let attrs = BTreeMap::from([
        (ATTR_NODE.to_string(), nodename.to_string()),
        (ATTR_TYPE.to_string(), ATTR_TYPE_IPIP.to_string()),
    ]);
    let ipam = Ipam::new(ds, nodename);
    match ipam
        .assign_ip(IpAddr::V4(tunnel), &handle, &attrs, None)
        .await
    {
        Ok(_) => {}
        Err(e) if is_already_exists(&e) => {
            info!("IPIP tunnel address already assigned in IPAM, continuing...")
        }
        Err(source) => {
            return Err(MigrateError::AssignTunnel { ip: tunnel, source });
        }
    }

    // The Calico Node update, retried on conflict (up to 5 times, then carry on, as
    // upstream). On the Kubernetes datastore it is a status update of the core Node whose
    // only change is this annotation; upstream's Node conversion also rewrites the other
    // Calico annotations from what it read (a no-op for valid ones, invalid ones dropped).
    for _ in 0..CONFLICT_RETRIES {
        let mut node = get_calico_node(kube, nodename).await?;
        set_annotation(&mut node, IPIP_ANNOTATION, &tunnel.to_string());
        let key = node_key(nodename);
        let resp = kube
            .send_json(
                Method::PUT,
                &format!("{}/status", node_path(nodename)),
                "application/json",
                &node,
            )
            .await
            .map_err(MigrateError::UpdateNode)?;
        if resp.ok() {
            break;
        }
        let e = api_error(&key, &resp);
        if e.is_conflict() {
            info!("Encountered update conflict, retrying...");
            tokio::time::sleep(opts.conflict_backoff).await;
            continue;
        }
        return Err(MigrateError::UpdateNode(e));
    }
    // Upstream logs the Node as first read here: an empty address, or a nil dereference
    // (a crash, then a restart) when that Node had no BGP annotations at all.
    info!(ip = %tunnel, "Assigned IPIP tunnel address to node");
    Ok(())
}

/// ClusterInformation `datastoreReady: false`, up to 5 attempts; the object as last read or
/// written (`None` when the last attempt conflicted).
async fn disable_cluster<D: Datastore>(
    ds: &D,
    opts: &Options,
) -> Result<Option<ClusterInformation>> {
    info!("setting datastore readiness to false");
    let mut cluster_info = None;
    for _ in 0..CONFLICT_RETRIES {
        let mut ci: ClusterInformation =
            get_resource(ds, Kind::ClusterInformation, None, "default")
                .await
                .map_err(MigrateError::FetchClusterInfo)?;
        // Already false: read again, up to 5 times, without writing (as upstream).
        if ci.spec.datastore_ready.unwrap_or(true) {
            ci.spec.datastore_ready = Some(false);
            match update_resource(ds, Kind::ClusterInformation, &mut ci).await {
                Ok(()) => {
                    cluster_info = Some(ci);
                    break;
                }
                Err(e) if e.is_conflict() => {
                    cluster_info = None;
                    info!("Encountered update conflict, retrying...");
                    tokio::time::sleep(opts.conflict_backoff).await;
                    continue;
                }
                Err(e) => return Err(MigrateError::DisableCluster(e)),
            }
        }
        cluster_info = Some(ci);
    }
    info!("successfully set datastore readiness to false");
    Ok(cluster_info)
}

/// A pod as the migration needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct PodRef {
    name: String,
    namespace: String,
}

/// This node's pods by `status.podIP` (a later pod with the same IP wins).
async fn pods_by_ip(kube: &KubeClient, nodename: &str) -> Result<HashMap<String, PodRef>> {
    info!("mapping pod ips to pods...");
    let path = format!(
        "/api/v1/pods?fieldSelector={}",
        query_escape(&format!("spec.nodeName={nodename}"))
    );
    let resp = kube.get(&path).await.map_err(MigrateError::ListPods)?;
    if !resp.ok() {
        return Err(MigrateError::ListPodsRefused(resp.status_object().message));
    }
    let list = resp.json().map_err(MigrateError::ListPods)?;
    let mut map = HashMap::new();
    for pod in list
        .get("items")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let text = |p: &str| {
            pod.pointer(p)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string()
        };
        let (name, namespace, ip) = (
            text("/metadata/name"),
            text("/metadata/namespace"),
            text("/status/podIP"),
        );
        info!(pod = %name, IP = %ip, namespace = %namespace, "mapping in pod");
        map.insert(ip, PodRef { name, namespace });
    }
    info!("successfully mapped pod ips to pods!");
    Ok(map)
}

/// Each allocation file, in name order: AssignIP of its address to its pod, then deleted.
async fn migrate_files<D: Datastore>(
    ds: &D,
    nodename: &str,
    dir: &Path,
    pods: &HashMap<String, PodRef>,
) -> Result<()> {
    info!("reading files from host-local IPAM data dir...");
    let read_err = |e: io::Error| MigrateError::ReadDataDir {
        source: PathError::new("open", dir, e),
    };
    let mut names = Vec::new();
    for entry in fs::read_dir(dir).map_err(read_err)? {
        names.push(
            entry
                .map_err(read_err)?
                .file_name()
                .to_string_lossy()
                .into_owned(),
        );
    }
    names.sort();
    let ipam = Ipam::new(ds, nodename);
    for name in names {
        info!(file = %name, "processing file...");
        let fname = dir.join(&name);
        let remove = |what: &Path| match go_remove(what) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(MigrateError::RemoveFile {
                source: PathError::new("remove", what, e),
            }),
            _ => Ok(()),
        };
        match classify(&name) {
            FileKind::LastReserved => {
                info!(file = %name, "skipping and removing last reserved ip file...");
                remove(&fname)?;
                info!(file = %name, "removed last reserved ip file");
                continue;
            }
            FileKind::Lock => {
                info!(file = %name, "skipping the lock...");
                continue;
            }
            FileKind::Allocation => {}
        }
        let ip = parse_file_ip(&name).map_err(|source| MigrateError::ParseIp {
            name: name.clone(),
            source,
        })?;
        let contents = read_file(&fname).map_err(|source| MigrateError::ReadFile { source })?;
        let container_id = container_id(&contents);
        let Some(pod) = pods.get(&name) else {
            info!(file = %name, ip = %name, "pod not found for IP, deleting and continuing");
            remove(&fname)?;
            continue;
        };
        let handle = format!("{NETWORK_NAME}.{container_id}");
        let attrs = BTreeMap::from([
            (ATTR_NODE.to_string(), nodename.to_string()),
            (ATTR_POD.to_string(), pod.name.clone()),
            (ATTR_NAMESPACE.to_string(), pod.namespace.clone()),
        ]);
        info!(file = %name, "assigning pod IP to Calico IPAM...");
        match ipam.assign_ip(ip, &handle, &attrs, None).await {
            Ok(_) => {}
            Err(e) if is_already_exists(&e) => {
                // Likely assigned by an earlier attempt that failed to delete the file.
                warn!(file = %name, "pod IP already assigned, skipping");
            }
            Err(e) => return Err(MigrateError::Assign(e)),
        }
        info!(file = %name, "pod IP assigned in Calico IPAM");
        info!(file = %name, "removing host-local allocation file");
        remove(&fname)?;
        info!(file = %name, "successfully removed file");
    }
    Ok(())
}

/// What upstream does with a file of the data dir, by its name.
#[derive(Debug, PartialEq, Eq)]
enum FileKind {
    /// `last_reserved_ip.<range>` (any name containing "last"): deleted, not migrated.
    LastReserved,
    /// host-local's `lock`: left alone.
    Lock,
    /// Named by the address it allocates.
    Allocation,
}

fn classify(name: &str) -> FileKind {
    if name.contains("last") {
        FileKind::LastReserved
    } else if name == "lock" {
        FileKind::Lock
    } else {
        FileKind::Allocation
    }
}

/// The container ID in an allocation file: its first line, trimmed. host-local writes
/// `<containerID>\r\n<ifname>` since plugins v0.8.6, only `<containerID>` before.
fn container_id(contents: &[u8]) -> String {
    let text = String::from_utf8_lossy(contents);
    text.split('\n')
        .next()
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The address a file is named by: upstream parses `<name>/32` as a CIDR (so an IPv6 name
/// parses too, and an IPv4-mapped one becomes IPv4).
fn parse_file_ip(name: &str) -> std::result::Result<IpAddr, ParseIpNetError> {
    parse_go_cidr(&format!("{name}/32")).map(|c| c.ip)
}

/// Go's `net.ParseCIDR` as libcalico-go's `net.ParseCIDR` wraps it.
#[derive(Debug, PartialEq, Eq)]
struct GoCidr {
    /// The address as written (IPv4-mapped IPv6 made IPv4, as libcalico-go does).
    ip: IpAddr,
    /// Whether the masked network is IPv4 (libcalico-go's `IPNet.Version() == 4`).
    network_is_v4: bool,
    /// Whether the address is its network's address (no host bits set).
    is_network_address: bool,
}

fn parse_go_cidr(s: &str) -> std::result::Result<GoCidr, ParseIpNetError> {
    let invalid = || ParseIpNetError(s.to_string());
    let (addr, mask) = s.split_once('/').ok_or_else(invalid)?;
    let ip: IpAddr = addr.parse().map_err(|_| invalid())?;
    let bits: u32 = if ip.is_ipv4() { 32 } else { 128 };
    if mask.is_empty() || mask.len() > 8 || !mask.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid());
    }
    let prefix: u32 = mask.parse().map_err(|_| invalid())?;
    if prefix > bits {
        return Err(invalid());
    }
    Ok(match ip {
        IpAddr::V4(v4) => {
            let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
            GoCidr {
                ip,
                network_is_v4: true,
                is_network_address: u32::from(v4) & mask == u32::from(v4),
            }
        }
        IpAddr::V6(v6) => {
            let mask = u128::MAX.checked_shl(128 - prefix).unwrap_or(0);
            let network = std::net::Ipv6Addr::from(u128::from(v6) & mask);
            GoCidr {
                ip: v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
                network_is_v4: network.to_ipv4_mapped().is_some(),
                is_network_address: network == v6,
            }
        }
    })
}

/// The podCIDR's address with its last byte incremented (wrapping, as Go's `tunIp[3]++`).
fn first_address(ip: Ipv4Addr) -> Ipv4Addr {
    let mut o = ip.octets();
    o[3] = o[3].wrapping_add(1);
    Ipv4Addr::from(o)
}

/// libcalico-go's `validatorv3.ValidateIPv4Network`: an IPv4 address, or an IPv4 CIDR whose
/// address is its network address.
fn valid_ipv4_network(s: &str) -> bool {
    if let Ok(c) = parse_go_cidr(s) {
        return c.ip.is_ipv4() && c.is_network_address;
    }
    match s.parse::<IpAddr>() {
        Ok(IpAddr::V4(_)) => true,
        Ok(IpAddr::V6(v6)) => v6.to_ipv4_mapped().is_some(),
        Err(_) => false,
    }
}

/// The Calico Node's `spec.bgp.ipv4IPIPTunnelAddr` as the Kubernetes datastore derives it
/// from the core Node (`K8sNodeToCalico`): with `USE_POD_CIDR` and a podCIDR, that CIDR's
/// first address (an error when it does not parse; none for IPv6); otherwise the annotation,
/// ignored when it is not a valid IPv4 network.
fn calico_ipip_tunnel_addr(
    node: &Value,
    use_pod_cidr: bool,
) -> std::result::Result<String, ParseIpNetError> {
    let pod_cidr = node
        .pointer("/spec/podCIDR")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if use_pod_cidr && !pod_cidr.is_empty() {
        let c = parse_go_cidr(pod_cidr)?;
        return Ok(match c.ip {
            IpAddr::V4(v4) => first_address(v4).to_string(),
            IpAddr::V6(_) => String::new(),
        });
    }
    let annotation = node
        .pointer("/metadata/annotations")
        .and_then(|a| a.get(IPIP_ANNOTATION))
        .and_then(Value::as_str)
        .unwrap_or_default();
    Ok(if valid_ipv4_network(annotation) {
        annotation.to_string()
    } else {
        String::new()
    })
}

fn set_annotation(node: &mut Value, key: &str, value: &str) {
    let Some(obj) = node.as_object_mut() else {
        return;
    };
    let meta = obj
        .entry("metadata")
        .or_insert_with(|| Value::Object(Default::default()));
    let Some(meta) = meta.as_object_mut() else {
        return;
    };
    let ann = meta
        .entry("annotations")
        .or_insert_with(|| Value::Object(Default::default()));
    if !ann.is_object() {
        *ann = Value::Object(Default::default());
    }
    if let Some(a) = ann.as_object_mut() {
        a.insert(key.to_string(), Value::String(value.to_string()));
    }
}

fn node_key(nodename: &str) -> Key {
    Key::resource(Kind::Node, None, nodename)
}

fn node_path(nodename: &str) -> String {
    crate::datastore::kubernetes::core_objects::node_path(nodename)
}

/// The core Node, read as the Calico Node is (errors in libcalico-go's terms).
async fn get_calico_node(kube: &KubeClient, nodename: &str) -> Result<Value> {
    let resp = kube
        .get(&node_path(nodename))
        .await
        .map_err(MigrateError::GetCalicoNode)?;
    if !resp.ok() {
        return Err(MigrateError::GetCalicoNode(api_error(
            &node_key(nodename),
            &resp,
        )));
    }
    resp.json().map_err(MigrateError::GetCalicoNode)
}

fn is_already_exists(e: &IpamError) -> bool {
    match e {
        IpamError::AddressInUse(_) => true,
        IpamError::Datastore(d) => d.is_already_exists(),
        _ => false,
    }
}

/// A query value escaped as Go's `url.QueryEscape` (node names need only `=`).
fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            b' ' => out.push('+'),
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

// ------------------------------------------------------------------ files, as Go sees them

/// Go's `os.Remove`: unlink, else rmdir; the unlink error unless rmdir's says more.
fn go_remove(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(unlink) => match fs::remove_dir(path) {
            Ok(()) => Ok(()),
            Err(rmdir) if rmdir.raw_os_error() != Some(libc::ENOTDIR) => Err(rmdir),
            Err(_) => Err(unlink),
        },
    }
}

/// Go's `os.ReadFile` (`open …` / `read …` errors: a directory opens, and its read fails),
/// except that what is neither a file nor a directory (a FIFO would block) is refused at
/// the open (`crate::support::input_file`).
fn read_file(path: &Path) -> std::result::Result<Vec<u8>, PathError> {
    let mut f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| PathError::new("open", path, e))?;
    if !f.metadata().is_ok_and(|m| m.is_file() || m.is_dir()) {
        let e = crate::support::input_file::not_regular();
        return Err(PathError::new("open", path, e));
    }
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)
        .map_err(|e| PathError::new("read", path, e))?;
    Ok(buf)
}

/// host-local's own lock (`disk.New` + `FileLock`): `<dir>/lock`, created 0750 and opened
/// read-only, `flock(LOCK_EX)` without a timeout. Unlocking twice is harmless.
enum HostLocalLock {
    Unlocked(File),
    Locked(Flock<File>),
    /// Only while changing state.
    Gone,
}

impl HostLocalLock {
    fn open(dir: &Path) -> std::result::Result<HostLocalLock, DiskError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(|e| PathError::new("mkdir", dir, e))?;
        let meta = fs::metadata(dir).map_err(|e| PathError::new("stat", dir, e))?;
        let path = if meta.is_dir() {
            dir.join("lock")
        } else {
            dir.to_path_buf()
        };
        // Non-blocking, and a regular file only: a FIFO here must not stall the init
        // container (`crate::support::input_file`).
        let f = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_CREAT | libc::O_NONBLOCK)
            .mode(0o750)
            .open(&path)
            .map_err(DiskError::Open)?;
        if !f.metadata().is_ok_and(|m| m.is_file()) {
            let e = crate::support::input_file::not_regular();
            return Err(PathError::new("open", &path, e).into());
        }
        Ok(HostLocalLock::Unlocked(f))
    }

    fn lock(&mut self) -> std::result::Result<(), DiskError> {
        match std::mem::replace(self, HostLocalLock::Gone) {
            HostLocalLock::Unlocked(f) => match Flock::lock(f, FlockArg::LockExclusive) {
                Ok(l) => {
                    *self = HostLocalLock::Locked(l);
                    Ok(())
                }
                Err((f, e)) => {
                    *self = HostLocalLock::Unlocked(f);
                    Err(DiskError::Flock(e))
                }
            },
            other => {
                *self = other;
                Ok(())
            }
        }
    }

    fn unlock(&mut self) -> std::result::Result<(), DiskError> {
        match std::mem::replace(self, HostLocalLock::Gone) {
            HostLocalLock::Locked(l) => match l.unlock() {
                Ok(f) => {
                    *self = HostLocalLock::Unlocked(f);
                    Ok(())
                }
                Err((l, e)) => {
                    *self = HostLocalLock::Locked(l);
                    Err(DiskError::Flock(e))
                }
            },
            other => {
                *self = other;
                Ok(())
            }
        }
    }
}

/// Upstream's deferred unlock, with its log lines.
struct DeferredUnlock(HostLocalLock);

impl Drop for DeferredUnlock {
    fn drop(&mut self) {
        info!("releasing lock on host-local backend...");
        match self.0.unlock() {
            Ok(()) => info!("successfully released lock on host-local backend!"),
            Err(e) => error!(error = %e, "failed to release lock on host local backend"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::env_of;
    use serde_json::json;

    #[test]
    fn file_names_and_contents() {
        assert_eq!(classify("last_reserved_ip.0"), FileKind::LastReserved);
        assert_eq!(classify("lock"), FileKind::Lock);
        assert_eq!(classify("10.244.1.5"), FileKind::Allocation);
        // Newer host-local: `<id>\r\n<ifname>`; older: the ID alone, maybe with spaces.
        assert_eq!(container_id(b"abc123\r\neth0"), "abc123");
        assert_eq!(container_id(b"  abc123 \n"), "abc123");
        assert_eq!(container_id(b"abc123"), "abc123");
        assert_eq!(container_id(b""), "");
        assert_eq!(
            parse_file_ip("10.244.1.5").unwrap(),
            "10.244.1.5".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_file_ip("fd00:244:1::5").unwrap(),
            "fd00:244:1::5".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_file_ip("::ffff:10.0.0.9").unwrap(),
            "10.0.0.9".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            parse_file_ip("garbage").unwrap_err().to_string(),
            "invalid CIDR address: garbage/32"
        );
        // Go refuses leading zeros in IPv4 literals, as Rust does.
        assert!(parse_file_ip("010.1.1.1").is_err());
    }

    #[test]
    fn go_cidrs() {
        let c = parse_go_cidr("10.244.1.0/24").unwrap();
        assert_eq!(
            (c.ip.to_string(), c.network_is_v4),
            ("10.244.1.0".into(), true)
        );
        let c = parse_go_cidr("fd00:244:1::/64").unwrap();
        assert!(!c.network_is_v4);
        // An IPv4-mapped network is IPv4 to libcalico-go.
        let c = parse_go_cidr("::ffff:10.1.0.0/112").unwrap();
        assert_eq!(
            (c.ip.to_string(), c.network_is_v4),
            ("10.1.0.0".into(), true)
        );
        for bad in [
            "",
            "10.0.0.0",
            "10.0.0.0/33",
            "10.0.0.0/-1",
            "10.0.0.0/",
            "x/24",
        ] {
            assert_eq!(
                parse_go_cidr(bad).unwrap_err().to_string(),
                format!("invalid CIDR address: {bad}")
            );
        }
        assert_eq!(
            first_address("10.244.1.0".parse().unwrap()).to_string(),
            "10.244.1.1"
        );
        // Only the last byte moves, as `tunIp[3]++`.
        assert_eq!(
            first_address("10.244.1.255".parse().unwrap()).to_string(),
            "10.244.1.0"
        );
    }

    #[test]
    fn tunnel_address_of_the_calico_node() {
        let node = |ann: Value, cidr: &str| json!({"metadata":{"name":"n","annotations":ann},"spec":{"podCIDR":cidr}});
        let n = node(json!({}), "10.244.1.0/24");
        assert_eq!(calico_ipip_tunnel_addr(&n, false).unwrap(), "");
        // USE_POD_CIDR derives it from the podCIDR, annotation or not.
        assert_eq!(calico_ipip_tunnel_addr(&n, true).unwrap(), "10.244.1.1");
        let v6 = node(json!({}), "fd00::/64");
        assert_eq!(calico_ipip_tunnel_addr(&v6, true).unwrap(), "");
        let bad = node(json!({}), "nope");
        assert_eq!(
            calico_ipip_tunnel_addr(&bad, true).unwrap_err(),
            ParseIpNetError("nope".into())
        );
        let a = node(json!({IPIP_ANNOTATION: "10.244.1.1"}), "");
        assert_eq!(calico_ipip_tunnel_addr(&a, false).unwrap(), "10.244.1.1");
        assert_eq!(calico_ipip_tunnel_addr(&a, true).unwrap(), "10.244.1.1");
        // Invalid annotations are ignored, as the KDD node conversion ignores them.
        for ignored in ["10.244.1.1/24", "fd00::1", "bogus"] {
            let a = node(json!({IPIP_ANNOTATION: ignored}), "");
            assert_eq!(calico_ipip_tunnel_addr(&a, false).unwrap(), "", "{ignored}");
        }
        for valid in ["10.244.1.0/24", "10.244.1.1/32", "::ffff:10.0.0.1"] {
            assert!(valid_ipv4_network(valid), "{valid}");
        }
    }

    #[test]
    fn annotation_written_into_any_node_shape() {
        let mut n = json!({"metadata":{"name":"n"}});
        set_annotation(&mut n, IPIP_ANNOTATION, "10.0.0.1");
        assert_eq!(n["metadata"]["annotations"][IPIP_ANNOTATION], "10.0.0.1");
        let mut n = json!({"metadata":{"name":"n","annotations":{"a":"b"}}});
        set_annotation(&mut n, IPIP_ANNOTATION, "10.0.0.1");
        assert_eq!(n["metadata"]["annotations"]["a"], "b");
    }

    #[test]
    fn api_configuration_from_the_environment() {
        let (s, pod_cidr) = api_settings(&env_of(&[
            ("KUBECONFIG", "/kc"),
            ("DATASTORE_TYPE", "etcdv3"),
            ("ETCD_ENDPOINTS", "http://e:2379"),
        ]))
        .unwrap();
        // The datastore is Kubernetes whatever the environment says.
        assert_eq!(
            (
                s.datastore_type.as_str(),
                s.kube.kubeconfig.as_str(),
                pod_cidr
            ),
            ("kubernetes", "/kc", false)
        );
        let (s, _) = api_settings(&env_of(&[
            ("CALICO_KUBECONFIG", "/prefixed"),
            ("KUBECONFIG", "/plain"),
        ]))
        .unwrap();
        assert_eq!(s.kube.kubeconfig, "/prefixed");
        let (_, pod_cidr) = api_settings(&env_of(&[("USE_POD_CIDR", "true")])).unwrap();
        assert!(pod_cidr);
        let (_, pod_cidr) = api_settings(&env_of(&[
            ("CALICO_USE_POD_CIDR", "0"),
            ("USE_POD_CIDR", "true"),
        ]))
        .unwrap();
        assert!(!pod_cidr);
        // envconfig fails on a set but unparsable boolean, an empty one included.
        assert!(api_settings(&env_of(&[("USE_POD_CIDR", "")])).is_err());
        assert!(api_settings(&env_of(&[("USE_POD_CIDR", "yes")])).is_err());
    }

    #[test]
    fn default_kubeconfig_under_home() {
        let home = std::env::temp_dir().join(format!("upgrade-home-{}", std::process::id()));
        fs::create_dir_all(home.join(".kube")).unwrap();
        let home_s = home.display().to_string();
        let (s, _) = api_settings(&env_of(&[("HOME", &home_s)])).unwrap();
        assert_eq!(s.kube.kubeconfig, "");
        fs::write(home.join(".kube").join("config"), "").unwrap();
        let (s, _) = api_settings(&env_of(&[("HOME", &home_s)])).unwrap();
        assert_eq!(s.kube.kubeconfig, format!("{home_s}/.kube/config"));
        // Not when the environment picks etcd (the type is forced only afterwards) or
        // names an API server.
        let (s, _) = api_settings(&env_of(&[
            ("HOME", &home_s),
            ("ETCD_ENDPOINTS", "http://e:1"),
        ]))
        .unwrap();
        assert_eq!(s.kube.kubeconfig, "");
        let (s, _) = api_settings(&env_of(&[
            ("HOME", &home_s),
            ("K8S_API_ENDPOINT", "https://a:6443"),
        ]))
        .unwrap();
        assert_eq!(s.kube.kubeconfig, "");
        fs::remove_dir_all(&home).unwrap();
    }

    #[test]
    fn options_and_test_overrides() {
        let o = Options::default();
        assert_eq!(o.host_local_dir, PathBuf::from(HOST_LOCAL_DIR));
        assert_eq!(o.binaries_to_disable.len(), 2);
        assert_eq!(o.settle, Duration::from_secs(5));
        let o = Options::with_test_overrides(&env_of(&[
            (ENV_TEST_HOST_LOCAL_DIR, "/tmp/hl"),
            (ENV_TEST_BINARIES, "/tmp/a::/tmp/b"),
        ]));
        assert_eq!(o.host_local_dir, PathBuf::from("/tmp/hl"));
        assert_eq!(
            o.binaries_to_disable,
            vec![PathBuf::from("/tmp/a"), PathBuf::from("/tmp/b")]
        );
        let o = Options::with_test_overrides(&env_of(&[(ENV_TEST_BINARIES, "")]));
        assert!(o.binaries_to_disable.is_empty());
    }

    #[test]
    fn go_texts() {
        assert_eq!(
            query_escape("spec.nodeName=node-1"),
            "spec.nodeName%3Dnode-1"
        );
        let dir = std::env::temp_dir().join(format!("upgrade-rm-{}", std::process::id()));
        fs::create_dir_all(dir.join("sub")).unwrap();
        fs::write(dir.join("sub").join("f"), "").unwrap();
        // os.Remove removes files and empty directories; a full directory is ENOTEMPTY.
        assert_eq!(
            io_error_text(&go_remove(&dir.join("sub")).unwrap_err()),
            "directory not empty"
        );
        go_remove(&dir.join("sub").join("f")).unwrap();
        go_remove(&dir.join("sub")).unwrap();
        assert_eq!(
            go_remove(&dir.join("sub")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        let e = read_file(&dir).unwrap_err();
        assert_eq!(e.source.raw_os_error(), Some(libc::EISDIR));
        assert_eq!(
            e.to_string(),
            format!("read {}: is a directory", dir.display())
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn migrate_errors_keep_their_cause() {
        let file = Path::new("/d/10.0.0.1");
        let e = MigrateError::RemoveFile {
            source: PathError::new("remove", file, io::Error::from_raw_os_error(libc::EACCES)),
        };
        assert_eq!(
            e.to_string(),
            "failed to remove file /d/10.0.0.1: remove /d/10.0.0.1: permission denied"
        );
        let cause = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<PathError>());
        assert_eq!(
            cause.map(|p| p.source.kind()),
            Some(io::ErrorKind::PermissionDenied)
        );
        let e = MigrateError::ParseIp {
            name: "garbage".into(),
            source: parse_file_ip("garbage").unwrap_err(),
        };
        assert_eq!(
            e.to_string(),
            "failed to parse IP garbage: invalid CIDR address: garbage/32"
        );
        let e = MigrateError::LockHostLocal(DiskError::Flock(nix::errno::Errno::EINTR));
        assert_eq!(
            e.to_string(),
            "failed to acquire lock on host-local IPAM: interrupted system call"
        );
        // An address already assigned is told by its type, not by its text.
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert!(is_already_exists(&IpamError::AddressInUse(ip)));
        let lookalike = IpamError::Other("Address already assigned in block".into());
        assert!(!is_already_exists(&lookalike));
    }

    #[test]
    fn host_local_lock_is_created_and_unlocks_twice() {
        let dir = std::env::temp_dir().join(format!("upgrade-lock-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let mut l = HostLocalLock::open(&dir).unwrap();
        assert!(dir.join("lock").exists());
        l.lock().unwrap();
        // Another open file description cannot take it meanwhile.
        let other = File::open(dir.join("lock")).unwrap();
        let other = match Flock::lock(other, FlockArg::LockExclusiveNonblock) {
            Ok(_) => panic!("the lock is not held"),
            Err((f, _)) => f,
        };
        l.unlock().unwrap();
        l.unlock().unwrap();
        assert!(Flock::lock(other, FlockArg::LockExclusiveNonblock).is_ok());
        fs::remove_dir_all(&dir).unwrap();
    }
}
