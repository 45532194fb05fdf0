//! `calico` ADD (plugin.go cmdAdd, k8s.go CmdAddK8s): find the endpoint, get addresses from
//! the IPAM plugin, build the veth pair and routes, write the WorkloadEndpoint and Profile,
//! and return the result. Any failure after IPAM gives the addresses back.

use std::net::IpAddr;

use serde_json::Value;
use tracing::{info, warn};

use crate::dataplane::{self, NetworkingRequest};
use crate::datastore::model::WorkloadEndpoint;
use crate::error::{Error, Result};
use crate::net::IpNet;
use crate::plugin::endpoint;
use crate::plugin::ipam_exec;
use crate::plugin::{check_datastore_ready, prelude, Call};
use crate::skel::{CmdArgs, CniResult};

pub async fn cmd_add(args: &CmdArgs) -> Result<CniResult> {
    let call = prelude(args).await?;
    let conf = &call.conf;
    let mtu = conf.resolve_mtu()?;
    conf.validate_device_type()?;
    conf.validate_name()?;

    // The ready gate, the endpoint lookup and the profile lookup are independent reads:
    // one round trip. Nothing is written before the gate has passed.
    let want_profile = conf.policy.policy_type.is_empty();
    let (ready, existing, profile_exists) = tokio::join!(
        check_datastore_ready(&call.ds),
        endpoint::find_existing(&call.ds, &call.ids),
        async {
            if want_profile {
                endpoint::profile_exists(&call.ds, &conf.name).await
            } else {
                Ok(true)
            }
        }
    );
    ready?;
    let existing = existing?;
    let mut result = if call.ids.is_k8s() {
        add_k8s(args, &call, existing, mtu).await?
    } else {
        add_cni(args, &call, existing, mtu).await?
    };

    if want_profile {
        let ensured = match profile_exists {
            Ok(true) => Ok(()),
            Ok(false) => endpoint::create_profile(&call.ds, &conf.name, call.ids.is_k8s()).await,
            Err(e) => Err(e),
        };
        if let Err(e) = ensured {
            ipam_exec::release(&call.ds, &conf.ipam.ipam_type, args).await;
            return Err(e);
        }
    }
    // Calico IPAM sets no gateway; host-local's is meaningless for a /32 interface.
    for ip in &mut result.ips {
        ip.gateway = None;
    }
    Ok(result)
}

async fn add_cni(
    args: &CmdArgs,
    call: &Call,
    existing: Option<WorkloadEndpoint>,
    mtu: u32,
) -> Result<CniResult> {
    let conf = &call.conf;
    let ids = &call.ids;
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
        let result = endpoint::result_from_endpoint(&wep, &args.ifname, mtu, &args.netns);
        endpoint::write(&call.ds, &mut wep).await?;
        return Ok(result);
    }

    let result = ipam_add(call, args, "IPAM plugin returned no IP addresses in result").await?;
    let mut ids = ids.clone();
    let mut labels = conf.mesos_labels();
    if let Some(ns) = labels.remove("projectcalico.org.namespace") {
        ids.namespace = ns;
    }
    let name = ids.wep_name()?;
    let mut wep = endpoint::new_endpoint(&ids, &name, &conf.name);
    if !labels.is_empty() {
        wep.metadata.labels = Some(labels);
    }
    let veth = ids.host_veth_name();
    network_and_write(args, call, result, wep, veth, default_routes(), false, mtu).await
}

async fn add_k8s(
    args: &CmdArgs,
    call: &Call,
    existing: Option<WorkloadEndpoint>,
    mtu: u32,
) -> Result<CniResult> {
    let conf = &call.conf;
    let ids = &call.ids;
    if conf.policy.policy_type == "k8s" {
        return Err(Error::msg(
            "policy type \"k8s\" needs the Kubernetes API client, which this build does not have yet",
        ));
    }
    let routes = k8s_routes(conf)?;
    let result = ipam_add(call, args, "IPAM plugin returned missing IP config").await?;
    // A calico-ipam result without routes is a KubeVirt migration target: no host routes.
    let skip_host_routes = conf.ipam.ipam_type == "calico-ipam" && result.routes.is_empty();
    let mut wep = match existing {
        Some(mut w) => {
            info!(name = %w.metadata.name, "re-networking existing endpoint");
            w.spec.container_id = ids.container_id.clone();
            w
        }
        None => endpoint::new_endpoint(ids, &ids.wep_name()?, &conf.name),
    };
    wep.spec.profiles = vec![conf.name.clone()];
    let veth = ids.host_veth_name();
    network_and_write(args, call, result, wep, veth, routes, skip_host_routes, mtu).await
}

/// Runs the IPAM plugin; a result without addresses is given back and refused with `empty`.
async fn ipam_add(call: &Call, args: &CmdArgs, empty: &str) -> Result<CniResult> {
    let ipam_type = &call.conf.ipam.ipam_type;
    let result = ipam_exec::exec_add(&call.ds, ipam_type, args).await?;
    info!(ips = ?result.ips.iter().map(|i| i.address.to_string()).collect::<Vec<_>>(), "Got result from IPAM plugin");
    if result.ips.is_empty() {
        ipam_exec::release(&call.ds, ipam_type, args).await;
        return Err(Error::msg(empty));
    }
    Ok(result)
}

/// The common tail of both modes: build the interface, write the endpoint, shape the result.
/// Any failure gives the addresses back (and removes a half-built interface).
#[allow(clippy::too_many_arguments)]
async fn network_and_write(
    args: &CmdArgs,
    call: &Call,
    mut result: CniResult,
    mut wep: WorkloadEndpoint,
    host_veth: String,
    routes: Vec<IpNet>,
    skip_host_routes: bool,
    mtu: u32,
) -> Result<CniResult> {
    let ipam_type = &call.conf.ipam.ipam_type;
    wep.spec.ip_networks = endpoint::ip_networks(&result);
    let net = match network(
        args,
        call,
        &result,
        host_veth,
        routes,
        skip_host_routes,
        mtu,
    ) {
        Ok(n) => n,
        Err(e) => {
            ipam_exec::release(&call.ds, ipam_type, args).await;
            return Err(e);
        }
    };
    wep.spec.mac = net.container_mac.to_lowercase();
    wep.spec.interface_name = net.host_veth.clone();
    if let Err(e) = endpoint::write(&call.ds, &mut wep).await {
        undo_networking(args);
        ipam_exec::release(&call.ds, ipam_type, args).await;
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

/// `0.0.0.0/0` and `::/0`.
fn default_routes() -> Vec<IpNet> {
    vec![
        IpNet::new(IpAddr::from([0u8; 4]), 0),
        IpNet::new(IpAddr::from([0u16; 8]), 0),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// host-local's custom `ipam.routes` (gateways ignored), plus the defaults when
/// `include_default_routes`; otherwise the default routes.
fn k8s_routes(conf: &crate::config::NetConf) -> Result<Vec<IpNet>> {
    if conf.ipam.ipam_type != "host-local" {
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
    let mut out = Vec::new();
    for r in list {
        let dst = r.get("dst").and_then(Value::as_str).unwrap_or_default();
        let net: IpNet = dst
            .parse()
            .map_err(|e| Error::msg(format!("failed to parse route destination {dst:?}: {e}")))?;
        out.push(net.masked());
    }
    if out.is_empty() {
        return Ok(default_routes());
    }
    if conf.include_default_routes {
        out.extend(default_routes());
    }
    Ok(out)
}

fn network(
    args: &CmdArgs,
    call: &Call,
    result: &CniResult,
    host_veth: String,
    routes: Vec<IpNet>,
    skip_host_routes: bool,
    mtu: u32,
) -> Result<dataplane::NetworkingResult> {
    let req = NetworkingRequest {
        netns_path: args.netns.clone(),
        ifname: args.ifname.clone(),
        host_veth,
        mtu,
        num_queues: call.conf.num_queues(),
        ips: result
            .ips
            .iter()
            .map(|i| IpNet::host(i.address.addr))
            .collect(),
        routes,
        allow_ip_forwarding: call.conf.container_settings.allow_ip_forwarding,
        container_mac: None,
        skip_host_routes,
    };
    let net = dataplane::do_networking(&req).map_err(|e| {
        // Unlike upstream, do not leave a half-built veth for the runtime's DEL.
        undo_networking(args);
        Error::from(e)
    })?;
    info!(host_veth = %net.host_veth, mac = %net.container_mac, "Networked namespace");
    Ok(net)
}

fn undo_networking(args: &CmdArgs) {
    if let Err(e) = dataplane::clean_up_namespace(&args.netns, &args.ifname) {
        warn!(error = %e, "failed to remove the pod interface after a failed ADD");
    }
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
