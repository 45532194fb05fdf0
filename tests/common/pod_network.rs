//! A pod interface made in one go by ADD's own Linux dataplane path (`Dataplane::build`,
//! then `PodInterface::finish`), on the calling thread: for the root-only dataplane tests
//! and the dataplane bench, which describe a pod's interface in one `PodRequest`.

use calico_cni::dataplane::{
    AddressRequest, Dataplane, DataplaneError, Families, Linux, NetworkingResult, PodFacts,
    PodInterface, VethRequest,
};
use calico_cni::datastore::model::WorkloadEndpoint;
use calico_cni::support::net::IpNet;

/// One pod interface: ADD's `VethRequest` and `AddressRequest` together.
#[derive(Debug, Clone)]
pub struct PodRequest {
    /// `CNI_NETNS`.
    pub netns_path: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    pub host_veth: String,
    /// 0 = kernel default.
    pub mtu: u32,
    /// 0 = kernel default.
    pub num_queues: u32,
    pub ips: Vec<IpNet>,
    pub routes: Vec<IpNet>,
    pub allow_ip_forwarding: bool,
    pub container_mac: Option<[u8; 6]>,
    pub skip_host_routes: bool,
}

impl PodRequest {
    /// A pod interface `eth0` in `netns_path` (MTU 1450, one queue pair), with these
    /// addresses and route destinations.
    pub fn new(netns_path: &str, host_veth: &str, ips: &[&str], routes: &[&str]) -> PodRequest {
        PodRequest {
            netns_path: netns_path.to_string(),
            ifname: "eth0".to_string(),
            host_veth: host_veth.to_string(),
            mtu: 1450,
            num_queues: 1,
            ips: ips.iter().map(|s| s.parse().unwrap()).collect(),
            routes: routes.iter().map(|s| s.parse().unwrap()).collect(),
            allow_ip_forwarding: false,
            container_mac: None,
            skip_host_routes: false,
        }
    }
}

/// Builds and finishes the pod interface as ADD does, the families taken from the addresses,
/// on a runtime of its own (the calling thread must not be in one).
pub fn network(req: &PodRequest) -> Result<NetworkingResult, DataplaneError> {
    let families = Some(Families::of(&req.ips));
    let veth = VethRequest {
        netns_path: req.netns_path.clone(),
        ifname: req.ifname.clone(),
        host_veth: req.host_veth.clone(),
        mtu: req.mtu,
        num_queues: req.num_queues,
        container_mac: req.container_mac,
        families,
    };
    let addrs = AddressRequest {
        ips: req.ips.clone(),
        routes: req.routes.clone(),
        allow_ip_forwarding: req.allow_ip_forwarding,
        skip_host_routes: req.skip_host_routes,
    };
    // What only the gRPC dataplane reads.
    let (endpoint, annotations) = (WorkloadEndpoint::default(), Default::default());
    let pod = PodFacts {
        ips: &[],
        endpoint: &endpoint,
        annotations: &annotations,
    };
    calico_cni::call::client::block_on(async {
        let linux = Linux::open(req.netns_path.clone(), families);
        linux.build(veth).await?.finish(&addrs, &pod).await
    })
    .expect("a runtime for the dataplane")
}
