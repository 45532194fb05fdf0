//! The gRPC dataplane (`dataplane_options: {type: grpc, socket: ...}`), as Calico v3.32's: the
//! plugin builds no veth pair; an agent listening on a Unix socket or a TCP address
//! (Calico/VPP's, for one)
//! plumbs the pod's interface when asked with `Add` and removes it with `Del`
//! (`grpc/cnibackend.proto`, wire-compatible with upstream's). ADD gets the host interface's
//! name and the container's MAC back for the WorkloadEndpoint and the CNI result.
//!
//! Each request (connecting included) is bounded by upstream's 5 s and by the call's
//! deadline (`crate::support::deadline`), and runs on the call's own (current-thread) runtime.
//! Error texts are upstream's: a connection that cannot be made is the `Unavailable` status
//! grpc-go's first request reports (it dials lazily). The target is grpc-go's, with
//! upstream's default `passthrough` scheme (`GrpcTarget`): a Unix socket or a TCP address.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::Value;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use super::{
    AddressRequest, Dataplane, DataplaneError, NetworkingResult, PodFacts, PodInterface,
    VethRequest,
};
use crate::config::{ConfigError, NetConf};
use crate::datastore::model::WorkloadEndpoint;
use crate::skel::result::IpConfig;
use crate::support::net::IpNet;

/// The messages and the client generated from `grpc/cnibackend.proto` (build.rs).
#[allow(clippy::all, clippy::pedantic)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/grpc-client/cni.rs"));
}

use proto::cni_dataplane_client::CniDataplaneClient;

/// Upstream's bound on each request to the dataplane.
pub const TIMEOUT: Duration = Duration::from_secs(5);

/// What Go prints for an absent IP (`net.IP(nil).String()`): upstream sends it as the
/// gateway of an address IPAM gave none (Calico IPAM never does).
const NIL_IP: &str = "<nil>";

pub use crate::config::{grpc_target as target, GrpcTarget};

/// The gRPC dataplane as configured by the NetConf.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcDataplane {
    /// The `socket` option as written (for messages).
    socket: String,
    target: GrpcTarget,
    allow_ip_forwarding: bool,
    mtu: i32,
    /// Every string-valued option (`type` and `socket` included), passed along as upstream.
    options: HashMap<String, String>,
}

/// What ADD tells the dataplane about the pod, besides the configuration.
#[derive(Clone, Copy, Debug)]
pub struct AddArgs<'a> {
    /// `CNI_IFNAME`.
    pub ifname: &'a str,
    /// `CNI_NETNS`.
    pub netns: &'a str,
    /// The name the Linux dataplane would give the host veth (`cali...`).
    pub host_interface: &'a str,
    /// IPAM's addresses, with their gateways.
    pub ips: &'a [IpConfig],
    /// The pod's route destinations.
    pub routes: &'a [IpNet],
    /// The WorkloadEndpoint as it will be written (without interface and MAC).
    pub endpoint: &'a WorkloadEndpoint,
    /// The pod's annotations (Kubernetes with `policy.type: k8s`; else none).
    pub annotations: &'a BTreeMap<String, String>,
}

/// What the dataplane made: the host-side interface and the container's MAC (lower-case
/// `aa:bb:cc:dd:ee:ff`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Added {
    pub host_interface: String,
    pub container_mac: String,
}

impl GrpcDataplane {
    /// The gRPC dataplane if the NetConf chooses it (`None`: the Linux one). `mtu` is the
    /// resolved one (the NetConf's, else the MTU file's), as upstream passes it.
    pub fn for_conf(conf: &NetConf, mtu: u32) -> Result<Option<GrpcDataplane>, ConfigError> {
        conf.check_dataplane()?;
        if !conf.uses_grpc_dataplane() {
            return Ok(None);
        }
        GrpcDataplane::from_conf(conf, mtu).map(Some)
    }

    /// Reads `dataplane_options` (`socket` is required), `container_settings` and the MTU.
    pub fn from_conf(conf: &NetConf, mtu: u32) -> Result<GrpcDataplane, ConfigError> {
        let empty = serde_json::Map::new();
        let opts = conf.dataplane_options.as_ref().unwrap_or(&empty);
        let socket = opts
            .get("socket")
            .and_then(Value::as_str)
            .ok_or(ConfigError::GrpcSocket)?;
        let target = target(socket)?;
        let options = opts
            .iter()
            .filter_map(|(k, v)| v.as_str().map(|s| (k.clone(), s.to_string())))
            .collect();
        Ok(GrpcDataplane {
            socket: socket.to_string(),
            target,
            allow_ip_forwarding: conf.container_settings.allow_ip_forwarding,
            mtu: i32::try_from(mtu).unwrap_or(i32::MAX),
            options,
        })
    }

    /// The socket as configured.
    pub fn socket(&self) -> &str {
        &self.socket
    }

    /// The `AddRequest` for `a`, filled as upstream fills it.
    pub fn add_request(&self, a: &AddArgs<'_>) -> proto::AddRequest {
        let ep = a.endpoint;
        proto::AddRequest {
            interface_name: a.ifname.to_string(),
            netns: a.netns.to_string(),
            desired_host_interface_name: a.host_interface.to_string(),
            settings: Some(proto::ContainerSettings {
                allow_ip_forwarding: self.allow_ip_forwarding,
                mtu: self.mtu,
            }),
            container_ips: a
                .ips
                .iter()
                .map(|ip| proto::IpConfig {
                    address: ip.address.to_string(),
                    gateway: ip
                        .gateway
                        .map_or_else(|| NIL_IP.to_string(), |g| g.to_string()),
                })
                .collect(),
            container_routes: a.routes.iter().map(IpNet::to_string).collect(),
            workload: Some(proto::WorkloadIDs {
                name: ep.metadata.name.clone(),
                namespace: ep.metadata.namespace.clone(),
                labels: ep
                    .metadata
                    .labels
                    .iter()
                    .flatten()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                annotations: a
                    .annotations
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                endpoint: ep.spec.endpoint.clone(),
                node: ep.spec.node.clone(),
                orchestrator: ep.spec.orchestrator.clone(),
                pod: ep.spec.pod.clone(),
                ports: ep.spec.ports.iter().map(port).collect(),
            }),
            dataplane_options: self.options.clone(),
        }
    }

    /// The `DelRequest` for the pod interface `ifname` in `netns`.
    pub fn del_request(&self, ifname: &str, netns: &str) -> proto::DelRequest {
        proto::DelRequest {
            interface_name: ifname.to_string(),
            netns: netns.to_string(),
            dataplane_options: self.options.clone(),
        }
    }

    /// Asks the dataplane to plumb the pod's interface.
    pub async fn add(&self, a: &AddArgs<'_>) -> Result<Added, DataplaneError> {
        let request = self.add_request(a);
        info!(socket = %self.socket, netns = a.netns, iface = a.ifname, "Connecting to GRPC backend server (Add)");
        debug!(?request, "gRPC dataplane Add");
        let reply = self
            .bounded("Add", async {
                let mut client = self.client().await?;
                client.add(request).await.map_err(status_error)
            })
            .await?
            .into_inner();
        if !reply.successful {
            return Err(DataplaneError::GrpcReply(reply.error_message));
        }
        let container_mac = parse_mac(&reply.container_mac)?;
        info!(host_interface = %reply.host_interface_name, mac = %container_mac, "gRPC dataplane added the interface");
        Ok(Added {
            host_interface: reply.host_interface_name,
            container_mac,
        })
    }

    /// Asks the dataplane to remove the pod interface `ifname` in `netns`.
    pub async fn del(&self, ifname: &str, netns: &str) -> Result<(), DataplaneError> {
        let request = self.del_request(ifname, netns);
        info!(socket = %self.socket, netns, iface = ifname, "Connecting to GRPC backend server (Del)");
        let reply = self
            .bounded("Del", async {
                let mut client = self.client().await?;
                client.del(request).await.map_err(status_error)
            })
            .await?
            .into_inner();
        if !reply.successful {
            return Err(DataplaneError::GrpcReply(reply.error_message));
        }
        info!(
            netns,
            iface = ifname,
            "gRPC dataplane removed the interface"
        );
        Ok(())
    }

    /// Runs one request within `TIMEOUT` and the call's deadline.
    async fn bounded<T>(
        &self,
        rpc: &str,
        request: impl std::future::Future<Output = Result<T, DataplaneError>>,
    ) -> Result<T, DataplaneError> {
        let (until, capped) = crate::support::deadline::cap_at(TIMEOUT);
        match tokio::time::timeout_at(until, request).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(e)) => {
                warn!(error = %e, rpc, "request to grpc dataplane failed");
                Err(e)
            }
            Err(_) if capped => Err(DataplaneError::Deadline(crate::support::deadline::expired(
                format!("waiting for the gRPC dataplane ({rpc} at {})", self.socket),
            ))),
            Err(_) => {
                warn!(rpc, timeout = ?TIMEOUT, "request to grpc dataplane timed out");
                // What grpc-go reports when the request's context times out.
                Err(DataplaneError::GrpcStatus(
                    tonic::Status::deadline_exceeded("context deadline exceeded"),
                ))
            }
        }
    }

    /// A client on a new connection to the target (plain HTTP/2, no TLS). A failed dial is
    /// the status grpc-go's first request reports (it connects lazily).
    async fn client(&self) -> Result<CniDataplaneClient<Channel>, DataplaneError> {
        let stream = match &self.target {
            GrpcTarget::Unix(path) => tokio::net::UnixStream::connect(path)
                .await
                .map(Connected::Unix)
                .map_err(|e| dial_failed("unix", &path.display().to_string(), &e)),
            GrpcTarget::Tcp(addr) => dial_tcp(addr).await.map(Connected::Tcp),
        }?;
        let stream = std::sync::Mutex::new(Some(stream));
        let connector = tower::service_fn(move |_: http::Uri| {
            let taken = stream.lock().ok().and_then(|mut s| s.take());
            async move {
                taken
                    .map(hyper_util::rt::TokioIo::new)
                    .ok_or_else(|| std::io::Error::other("the connection was used"))
            }
        });
        // The URI only gives the requests their `:authority` (grpc-go sends `localhost` on
        // a Unix socket too); the connector hands over the connection made above.
        let channel = Endpoint::from_static("http://localhost")
            .connect_with_connector(connector)
            .await
            .map_err(|source| DataplaneError::GrpcConnect {
                target: self.socket.clone(),
                source,
            })?;
        Ok(CniDataplaneClient::new(channel))
    }
}

/// One endpoint port as upstream's `proto.Port` (the protocol as its name or number).
fn port(p: &Value) -> proto::Port {
    let text = |k: &str| p.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let num = |k: &str| {
        p.get(k)
            .and_then(Value::as_u64)
            .and_then(|n| u32::try_from(n).ok())
            .unwrap_or(0)
    };
    let protocol = match p.get("protocol") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => String::new(),
    };
    proto::Port {
        name: text("name"),
        protocol,
        port: num("port"),
        host_port: num("hostPort"),
        host_ip: text("hostIP"),
    }
}

/// The dataplane's MAC, as Go's `net.ParseMAC` reads a 6-byte one (`:` or `-` separated),
/// in `aa:bb:cc:dd:ee:ff` form; anything else is refused with Go's text.
pub fn parse_mac(raw: &str) -> Result<String, DataplaneError> {
    let bad = || DataplaneError::GrpcMac(raw.to_string());
    let sep = if raw.contains('-') { '-' } else { ':' };
    let parts: Vec<&str> = raw.split(sep).collect();
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut out = Vec::with_capacity(6);
    for p in parts {
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        out.push(p.to_ascii_lowercase());
    }
    Ok(out.join(":"))
}

/// A failed request's status, rendered as grpc-go renders it
/// (`rpc error: code = Unavailable desc = ...`).
fn status_error(s: tonic::Status) -> DataplaneError {
    DataplaneError::GrpcStatus(s)
}

/// grpc-go's name of a status code.
pub(super) fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

/// A made connection, of either kind.
enum Connected {
    Unix(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream),
}

impl tokio::io::AsyncRead for Connected {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connected::Unix(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Connected::Tcp(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl tokio::io::AsyncWrite for Connected {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Connected::Unix(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Connected::Tcp(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connected::Unix(s) => std::pin::Pin::new(s).poll_flush(cx),
            Connected::Tcp(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            Connected::Unix(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Connected::Tcp(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// A TCP dial as Go's `net.Dial("tcp", addr)` words its failures.
async fn dial_tcp(addr: &str) -> Result<tokio::net::TcpStream, DataplaneError> {
    let Some((host, _)) = addr.rsplit_once(':') else {
        return Err(grpc_unavailable(format!(
            "dial tcp: address {addr}: missing port in address"
        )));
    };
    let resolved: Vec<std::net::SocketAddr> = match tokio::net::lookup_host(addr).await {
        Ok(a) => a.collect(),
        Err(e) => {
            return Err(grpc_unavailable(format!(
                "dial tcp: lookup {}: {e}",
                host.trim_start_matches('[').trim_end_matches(']')
            )))
        }
    };
    let mut last = None;
    for a in &resolved {
        match tokio::net::TcpStream::connect(a).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(dial_failed("tcp", &a.to_string(), &e)),
        }
    }
    Err(last.unwrap_or_else(|| grpc_unavailable(format!("dial tcp: lookup {host}: no such host"))))
}

/// A failed dial, as the status grpc-go's request then fails with.
fn dial_failed(network: &str, addr: &str, e: &std::io::Error) -> DataplaneError {
    let why = match e.raw_os_error() {
        Some(errno) => crate::support::gocompat::errno_text(errno),
        None => e.to_string(),
    };
    grpc_unavailable(format!("dial {network} {addr}: connect: {why}"))
}

/// grpc-go's status of a request on a connection it could not make.
fn grpc_unavailable(dial: String) -> DataplaneError {
    DataplaneError::GrpcStatus(tonic::Status::unavailable(format!(
        "connection error: desc = \"transport: Error while dialing: {dial}\""
    )))
}

impl Dataplane for GrpcDataplane {
    type Interface = AgentInterface;

    /// Nothing is built before the addresses are known: the agent does it all at `Add`.
    async fn build(self, req: VethRequest) -> Result<AgentInterface, DataplaneError> {
        Ok(AgentInterface {
            dp: self,
            req,
            added: false,
        })
    }
}

/// The pod's interface as the agent makes it.
pub struct AgentInterface {
    dp: GrpcDataplane,
    req: VethRequest,
    /// The agent accepted this call's Add (undoing the ADD is then a Del).
    added: bool,
}

impl PodInterface for AgentInterface {
    fn result_has_host_addresses(&self) -> bool {
        false
    }

    /// The agent's Add (`pod` is what it is told besides the interface).
    async fn finish(
        &mut self,
        addrs: &AddressRequest,
        pod: &PodFacts<'_>,
    ) -> Result<NetworkingResult, DataplaneError> {
        let got = self
            .dp
            .add(&AddArgs {
                ifname: &self.req.ifname,
                netns: &self.req.netns_path,
                host_interface: &self.req.host_veth,
                ips: pod.ips,
                routes: &addrs.routes,
                endpoint: pod.endpoint,
                annotations: pod.annotations,
            })
            .await?;
        self.added = true;
        Ok(NetworkingResult {
            host_veth: got.host_interface,
            container_mac: got.container_mac,
            container_index: 0,
        })
    }

    /// A Del, if the agent accepted this call's Add.
    async fn remove(self) -> Result<(), DataplaneError> {
        if !self.added {
            return Ok(());
        }
        info!(
            netns = self.req.netns_path,
            iface = self.req.ifname,
            "Asking the gRPC dataplane to remove the interface of this failed ADD."
        );
        self.dp.del(&self.req.ifname, &self.req.netns_path).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datastore::model::WorkloadEndpointSpec;
    use serde_json::json;

    fn conf(extra: Value) -> NetConf {
        let mut v = json!({"name": "net1", "type": "calico"});
        if let (Some(o), Value::Object(e)) = (v.as_object_mut(), extra) {
            o.extend(e);
        }
        NetConf::parse(v.to_string().as_bytes()).unwrap()
    }

    #[test]
    fn targets_as_grpc_go_reads_them() {
        let unix = |s: &str| match target(s) {
            Ok(GrpcTarget::Unix(p)) => p.display().to_string(),
            other => panic!("{s}: {other:?}"),
        };
        assert_eq!(
            unix("unix:///var/run/calico/cni-server.sock"),
            "/var/run/calico/cni-server.sock"
        );
        assert_eq!(unix("unix:/run/x.sock"), "/run/x.sock");
        assert_eq!(unix("unix:relative.sock"), "relative.sock");
        // The passthrough resolver: anything else is dialed over TCP as given.
        for (t, addr) in [
            ("localhost:50051", "localhost:50051"),
            ("dns:///cni:50051", "cni:50051"),
            (
                "/var/run/calico/cni-server.sock",
                "/var/run/calico/cni-server.sock",
            ),
            ("run/x.sock", "run/x.sock"),
        ] {
            assert_eq!(target(t).ok(), Some(GrpcTarget::Tcp(addr.into())), "{t}");
        }
        for bad in [
            "unix://host/run/x.sock",
            "unix://",
            "unix:",
            "unix-abstract:cni",
        ] {
            let e = target(bad).unwrap_err();
            assert!(
                matches!(&e, ConfigError::GrpcAddress { socket, .. } if socket == bad),
                "{bad}: {e}"
            );
        }
    }

    #[tokio::test]
    async fn a_failed_dial_is_grpc_gos_unavailable_status() {
        let e = dial_tcp("/run/x.sock").await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial tcp: address /run/x.sock: missing port in address\""
        );
        let e = dial_tcp("127.0.0.1:1").await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial tcp 127.0.0.1:1: connect: connection refused\""
        );
    }

    #[test]
    fn from_conf_reads_options_settings_and_mtu() {
        let c = conf(json!({
            "dataplane_options": {"type": "grpc", "socket": "unix:///run/cni.sock",
                "extra": "x", "number": 5, "flag": true},
            "container_settings": {"allow_ip_forwarding": true},
        }));
        let dp = GrpcDataplane::for_conf(&c, 1440).unwrap().unwrap();
        assert_eq!(dp.socket(), "unix:///run/cni.sock");
        assert_eq!(dp.target, GrpcTarget::Unix("/run/cni.sock".into()));
        assert!(dp.allow_ip_forwarding);
        assert_eq!(dp.mtu, 1440);
        // String values only, as upstream.
        let mut keys: Vec<_> = dp.options.keys().cloned().collect();
        keys.sort();
        assert_eq!(keys, ["extra", "socket", "type"]);
        assert_eq!(dp.options["type"], "grpc");

        assert_eq!(GrpcDataplane::for_conf(&conf(json!({})), 0).unwrap(), None);
        let no_type = conf(json!({"dataplane_options": {"socket": "unix:///x"}}));
        assert_eq!(GrpcDataplane::for_conf(&no_type, 0).unwrap(), None);
        let no_socket = conf(json!({"dataplane_options": {"type": "grpc", "socket": 1}}));
        let e = GrpcDataplane::for_conf(&no_socket, 0).unwrap_err();
        assert_eq!(e.to_string(), "GRPC dataplane socket not configured");
        let bad = conf(json!({"dataplane_options": {"type": "grpc", "socket": "unix://h/x"}}));
        assert!(matches!(
            GrpcDataplane::for_conf(&bad, 0),
            Err(ConfigError::GrpcAddress { .. })
        ));
    }

    fn endpoint() -> WorkloadEndpoint {
        let mut w = WorkloadEndpoint::default();
        w.metadata.name = "node1-k8s-nginx-eth0".into();
        w.metadata.namespace = "default".into();
        w.metadata.labels = Some(BTreeMap::from([("app".into(), "web".into())]));
        w.spec = WorkloadEndpointSpec {
            orchestrator: "k8s".into(),
            node: "node1".into(),
            pod: "nginx".into(),
            endpoint: "eth0".into(),
            ports: vec![
                json!({"name": "http", "protocol": "TCP", "port": 80, "hostPort": 8080, "hostIP": "10.0.0.1"}),
                json!({"name": "n", "protocol": 132, "port": 9}),
            ],
            ..Default::default()
        };
        w
    }

    #[test]
    fn add_request_is_filled_as_upstream() {
        let c = conf(json!({"dataplane_options": {"type": "grpc", "socket": "unix:///s"}}));
        let dp = GrpcDataplane::from_conf(&c, 9000).unwrap();
        let ips = vec![
            IpConfig {
                address: "10.65.0.5/32".parse().unwrap(),
                gateway: None,
                interface: None,
            },
            IpConfig {
                address: "10.1.2.3/24".parse().unwrap(),
                gateway: Some("10.1.2.1".parse().unwrap()),
                interface: None,
            },
            IpConfig {
                address: "fd80::5/128".parse().unwrap(),
                gateway: None,
                interface: None,
            },
        ];
        let routes: Vec<IpNet> = vec!["0.0.0.0/0".parse().unwrap(), "::/0".parse().unwrap()];
        let ep = endpoint();
        let annotations = BTreeMap::from([("k".to_string(), "v".to_string())]);
        let r = dp.add_request(&AddArgs {
            ifname: "eth0",
            netns: "/var/run/netns/pod",
            host_interface: "cali12345678901",
            ips: &ips,
            routes: &routes,
            endpoint: &ep,
            annotations: &annotations,
        });
        assert_eq!(r.interface_name, "eth0");
        assert_eq!(r.netns, "/var/run/netns/pod");
        assert_eq!(r.desired_host_interface_name, "cali12345678901");
        assert_eq!(
            r.settings,
            Some(proto::ContainerSettings {
                allow_ip_forwarding: false,
                mtu: 9000
            })
        );
        let ips: Vec<(&str, &str)> = r
            .container_ips
            .iter()
            .map(|i| (i.address.as_str(), i.gateway.as_str()))
            .collect();
        assert_eq!(
            ips,
            [
                ("10.65.0.5/32", "<nil>"),
                ("10.1.2.3/24", "10.1.2.1"),
                ("fd80::5/128", "<nil>")
            ]
        );
        assert_eq!(r.container_routes, ["0.0.0.0/0", "::/0"]);
        let w = r.workload.unwrap();
        assert_eq!(w.name, "node1-k8s-nginx-eth0");
        assert_eq!(w.namespace, "default");
        assert_eq!(w.labels, HashMap::from([("app".into(), "web".into())]));
        assert_eq!(w.annotations, HashMap::from([("k".into(), "v".into())]));
        assert_eq!(
            (
                w.endpoint.as_str(),
                w.node.as_str(),
                w.orchestrator.as_str(),
                w.pod.as_str()
            ),
            ("eth0", "node1", "k8s", "nginx")
        );
        assert_eq!(
            w.ports,
            [
                proto::Port {
                    name: "http".into(),
                    protocol: "TCP".into(),
                    port: 80,
                    host_port: 8080,
                    host_ip: "10.0.0.1".into()
                },
                proto::Port {
                    name: "n".into(),
                    protocol: "132".into(),
                    port: 9,
                    host_port: 0,
                    host_ip: String::new()
                }
            ]
        );
        assert_eq!(r.dataplane_options.len(), 2);
        assert_eq!(r.dataplane_options["socket"], "unix:///s");

        let d = dp.del_request("eth0", "/var/run/netns/pod");
        assert_eq!(
            (d.interface_name.as_str(), d.netns.as_str()),
            ("eth0", "/var/run/netns/pod")
        );
        assert_eq!(d.dataplane_options, r.dataplane_options);
    }

    #[test]
    fn macs_and_error_texts() {
        assert_eq!(parse_mac("02:00:00:00:00:0A").unwrap(), "02:00:00:00:00:0a");
        assert_eq!(parse_mac("02-00-00-00-00-0a").unwrap(), "02:00:00:00:00:0a");
        for bad in ["", "02:00:00:00:00", "02:00:00:00:00:0g", "0200.0000.000a"] {
            assert_eq!(
                parse_mac(bad).unwrap_err().to_string(),
                format!("address {bad}: invalid MAC address")
            );
        }
        assert_eq!(
            DataplaneError::GrpcReply("no vpp".into()).to_string(),
            "grpc dataplane error: no vpp"
        );
        assert_eq!(
            status_error(tonic::Status::unavailable("connection reset")).to_string(),
            "rpc error: code = Unavailable desc = connection reset"
        );
        assert_eq!(
            status_error(tonic::Status::cancelled("x")).to_string(),
            "rpc error: code = Canceled desc = x"
        );
    }

    /// Nothing listening: grpc-go's status for a connection it could not make, at once.
    #[test]
    fn no_server_is_a_connection_error() {
        let dir = std::env::temp_dir().join(format!("grpc-unit-{}", std::process::id()));
        let socket = format!("unix://{}/none.sock", dir.display());
        let c = conf(json!({"dataplane_options": {"type": "grpc", "socket": socket}}));
        let dp = GrpcDataplane::from_conf(&c, 0).unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt.block_on(dp.del("eth0", "/x")).unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix {}/none.sock: connect: no such file or directory\"",
                dir.display()
            )
        );
    }
}
