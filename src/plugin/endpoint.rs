//! The WorkloadEndpoint and Profile the plugin reads and writes (etcd: clientv3 semantics).

use std::collections::BTreeMap;

use serde_json::json;
use tracing::{debug, info};

use crate::config::identifiers::WepIdentifiers;
use crate::datastore::model::{Profile, ProfileSpec, WorkloadEndpoint};
use crate::datastore::resources::{create_resource, get_resource, list_resources, update_resource};
use crate::datastore::{Datastore, Kind, ListKind};
use crate::error::{Error, Result};
use crate::skel::result::{Interface, IpConfig};
use crate::skel::CniResult;
use crate::support::net::IpNet;

/// This workload's existing endpoint (any interface name), found by name-prefix listing.
pub async fn find_existing<D: Datastore>(
    ds: &D,
    ids: &WepIdentifiers,
) -> Result<Option<WorkloadEndpoint>> {
    let prefix = ids.wep_prefix().map_err(Error::IdentifierPrefix)?;
    let weps: Vec<WorkloadEndpoint> = list_resources(
        ds,
        &ListKind::Resources {
            kind: Kind::WorkloadEndpoint,
            namespace: Some(ids.namespace.clone()),
            name_prefix: Some(prefix),
        },
    )
    .await?;
    let found = weps
        .into_iter()
        .find(|w| ids.name_matches(&w.metadata.name));
    if let Some(w) = &found {
        info!(name = %w.metadata.name, "Calico CNI found existing endpoint");
    }
    Ok(found)
}

/// Creates a new endpoint, or compare-and-swaps an existing one (it carries its revision).
pub async fn write<D: Datastore>(ds: &D, wep: &mut WorkloadEndpoint) -> Result<()> {
    if wep.metadata.resource_version.is_empty() {
        create_resource(ds, Kind::WorkloadEndpoint, wep).await?;
    } else {
        update_resource(ds, Kind::WorkloadEndpoint, wep).await?;
    }
    debug!(name = %wep.metadata.name, "wrote endpoint");
    Ok(())
}

/// A new endpoint skeleton for these identifiers.
pub fn new_endpoint(ids: &WepIdentifiers, name: &str, network: &str) -> WorkloadEndpoint {
    let mut wep = WorkloadEndpoint::new(
        "WorkloadEndpoint",
        name,
        Some(&ids.namespace),
        Default::default(),
    );
    wep.spec.orchestrator = ids.orchestrator.clone();
    wep.spec.node = ids.node.clone();
    wep.spec.container_id = ids.container_id.clone();
    wep.spec.pod = ids.pod.clone();
    wep.spec.endpoint = ids.endpoint.clone();
    wep.spec.profiles = vec![network.to_string()];
    wep
}

/// `spec.ipNetworks`: every address as a host network (/32, /128).
pub fn ip_networks(result: &CniResult) -> Vec<String> {
    result
        .ips
        .iter()
        .map(|ip| IpNet::host(ip.address.addr).to_string())
        .collect()
}

/// The result for an endpoint that already exists (cni mode second ADD): its addresses and
/// interfaces, no routes.
pub fn result_from_endpoint(
    wep: &WorkloadEndpoint,
    ifname: &str,
    mtu: i64,
    netns: &str,
) -> CniResult {
    let ips = wep
        .spec
        .ip_networks
        .iter()
        .filter_map(|s| s.parse::<IpNet>().ok())
        .map(|address| IpConfig {
            address,
            gateway: None,
            interface: Some(1),
        })
        .collect();
    CniResult {
        interfaces: interfaces(&wep.spec.interface_name, ifname, &wep.spec.mac, mtu, netns),
        ips,
        ..Default::default()
    }
}

/// `[{name: host veth}, {name: ifname, mac, mtu, sandbox}]`.
pub fn interfaces(
    host_veth: &str,
    ifname: &str,
    mac: &str,
    mtu: i64,
    netns: &str,
) -> Vec<Interface> {
    vec![
        Interface {
            name: host_veth.to_string(),
            ..Default::default()
        },
        Interface {
            name: ifname.to_string(),
            mac: mac.to_string(),
            mtu,
            sandbox: netns.to_string(),
        },
    ]
}

/// Whether Profile `<network>` exists.
pub async fn profile_exists<D: Datastore>(ds: &D, network: &str) -> Result<bool> {
    let got: Result<Profile, _> = get_resource(ds, Kind::Profile, None, network).await;
    match got {
        Ok(_) => Ok(true),
        Err(e) if e.is_not_found() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Profile `<network>` as the CNI creates it (it never updates one): allow-all egress,
/// ingress from the same profile (cni) or from anywhere (k8s), labelsToApply
/// `{<network>: ""}`.
pub fn new_profile(network: &str, k8s: bool) -> Profile {
    // libcalico-go's Rule has `source` and `destination` as structs, which Go's encoder
    // writes even when empty (`omitempty` does not apply to structs): `{}` in every rule.
    let ingress = if k8s {
        json!({"action": "Allow", "source": {}, "destination": {}})
    } else {
        json!({"action": "Allow", "source": {"selector": format!("has({network})")}, "destination": {}})
    };
    let spec = ProfileSpec {
        ingress: vec![ingress],
        egress: vec![json!({"action": "Allow", "source": {}, "destination": {}})],
        labels_to_apply: Some(BTreeMap::from([(network.to_string(), String::new())])),
        ..Default::default()
    };
    Profile::new("Profile", network, None, spec)
}

/// Creates the profile. One that appeared meanwhile (another ADD created it first) is
/// fine: profiles are never updated, so it is the same. Upstream fails the ADD there.
pub async fn create_profile<D: Datastore>(ds: &D, profile: &mut Profile) -> Result<()> {
    info!(profile = %profile.metadata.name, "Calico CNI creating profile");
    match create_resource(ds, Kind::Profile, profile).await {
        Ok(()) => Ok(()),
        Err(e) if e.is_already_exists() => {
            info!(profile = %profile.metadata.name, "profile was created meanwhile");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}
