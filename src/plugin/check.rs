//! `calico` CHECK: compares the previous result (which the runtime sends as `prevResult`)
//! with reality. Upstream only prints "OK"; this checks what ptp does and more:
//! * the kernel (`dataplane::check`): the pod's interface, MAC, MTU, addresses and routes,
//!   the host veth, its MAC, state and sysctls, and the host routes;
//!   not with the gRPC dataplane, whose agent made the interface (`dataplane::grpc`);
//! * the datastore: the WorkloadEndpoint (on Kubernetes, the pod) exists, belongs to this
//!   container, and has the result's addresses, interface and MAC;
//! * the IPAM: Calico IPAM's handle holds the addresses (in-process), or the IPAM plugin's
//!   own CHECK.
//!
//! Success prints nothing; the first mismatch is a code-999 error naming it. The kernel and
//! the datastore are read at the same time.

use std::net::IpAddr;

use crate::dataplane::{self, check::Expected};
use crate::datastore::model::WorkloadEndpointSpec;
use crate::datastore::resources::get_resource;
use crate::datastore::Kind;
use crate::error::{CheckError, Result};
use crate::plugin::ipam::{IpamDriver, IpamKind};
use crate::plugin::{add, connect, load, Call, Verb};
use crate::skel::result::prev_result;
use crate::skel::{CmdArgs, CniResult};
use crate::support::net::IpNet;

pub async fn cmd_check(args: &CmdArgs) -> Result<()> {
    let conf = load(args)?;
    let prev = prev_result(&args.stdin_data)?;
    if prev.ips.is_empty() {
        return Err(CheckError::ResultWithoutAddresses.into());
    }
    conf.check_dataplane()?;
    let call = connect(args, conf, Verb::Other).await?;
    let expected = expected(args, &call, &prev)?;
    // The gRPC dataplane's agent made the pod's interface, not us: nothing of ours to find
    // in the kernel.
    let kernel = async {
        if call.conf.uses_grpc_dataplane() {
            tracing::info!("gRPC dataplane: the kernel is not compared with the previous result");
            return Ok(());
        }
        dataplane::check::verify(&expected).await
    };
    let (kernel, endpoint) = tokio::join!(kernel, check_endpoint(args, &call, &prev));
    kernel?;
    endpoint?;
    // Calico IPAM in-process: the handle holds the addresses; any other IPAM: its CHECK.
    call.ipam().check(args, &prev).await
}

/// What ADD made, from the previous result and the config.
fn expected(args: &CmdArgs, call: &Call, prev: &CniResult) -> Result<Expected> {
    let host_veth = prev
        .interfaces
        .iter()
        .find(|i| i.sandbox.is_empty() && !i.name.is_empty())
        .map(|i| i.name.clone())
        .unwrap_or_else(|| call.ids.host_veth_name());
    let container = prev
        .interfaces
        .iter()
        .find(|i| !i.sandbox.is_empty() && i.name == args.ifname);
    let ips: Vec<IpAddr> = prev.ips.iter().map(|i| i.address.addr).collect();
    let routes: Vec<IpNet> = if call.plan.k8s {
        add::k8s_routes(&call.conf)?
    } else {
        add::default_routes()
    };
    Ok(Expected {
        netns_path: args.netns.clone(),
        ifname: args.ifname.clone(),
        host_veth,
        container_mac: container
            .map(|c| c.mac.to_lowercase())
            .filter(|m| !m.is_empty()),
        // A negative MTU was never set on the interface (the kernel's default was kept).
        mtu: container
            .and_then(|c| u32::try_from(c.mtu).ok())
            .unwrap_or_default(),
        ips,
        routes,
        // ADD skips them for a calico-ipam result without routes (KubeVirt targets).
        host_routes: !(call.plan.ipam == IpamKind::Calico && prev.routes.is_empty()),
    })
}

/// The endpoint (etcd) or the pod (Kubernetes) agrees with the previous result.
async fn check_endpoint(args: &CmdArgs, call: &Call, prev: &CniResult) -> Result<()> {
    let ids = &call.ids;
    let name = ids.wep_name()?;
    let endpoint = || format!("{}/{name}", ids.namespace);
    let wep = match get_resource::<_, WorkloadEndpointSpec>(
        &call.ds,
        Kind::WorkloadEndpoint,
        Some(&ids.namespace),
        &name,
    )
    .await
    {
        Ok(w) => w,
        Err(e) if e.is_not_found() => {
            return Err(CheckError::NoEndpoint {
                endpoint: endpoint(),
            }
            .into())
        }
        Err(e) => return Err(e.into()),
    };
    let spec = &wep.spec;
    if !spec.container_id.is_empty() && spec.container_id != args.container_id {
        return Err(CheckError::OtherContainer {
            endpoint: endpoint(),
            container: spec.container_id.clone(),
        }
        .into());
    }
    let mut want: Vec<IpAddr> = prev.ips.iter().map(|i| i.address.addr).collect();
    let mut got: Vec<IpAddr> = spec
        .ip_networks
        .iter()
        .filter_map(|n| n.parse::<IpNet>().ok().map(|n| n.addr))
        .collect();
    want.sort();
    got.sort();
    if want != got {
        return Err(CheckError::Addresses {
            endpoint: endpoint(),
            stored: join(&got),
            result: join(&want),
        }
        .into());
    }
    if let Some(host) = prev.interfaces.iter().find(|i| i.sandbox.is_empty()) {
        if !spec.interface_name.is_empty() && spec.interface_name != host.name {
            return Err(CheckError::Interface {
                endpoint: endpoint(),
                stored: spec.interface_name.clone(),
                result: host.name.clone(),
            }
            .into());
        }
    }
    let container = prev
        .interfaces
        .iter()
        .find(|i| !i.sandbox.is_empty() && i.name == args.ifname);
    if let Some(c) = container.filter(|c| !c.mac.is_empty() && !spec.mac.is_empty()) {
        if !c.mac.eq_ignore_ascii_case(&spec.mac) {
            return Err(CheckError::Mac {
                endpoint: endpoint(),
                stored: spec.mac.clone(),
                result: c.mac.clone(),
            }
            .into());
        }
    }
    Ok(())
}

fn join(ips: &[IpAddr]) -> String {
    ips.iter()
        .map(IpAddr::to_string)
        .collect::<Vec<_>>()
        .join(" ")
}
