//! ADD for any container but a Kubernetes pod (plugin.go cmdAdd's cni path): a new
//! endpoint with the NetConf's addresses, or the same container added again.

use tracing::info;

use super::commit::{addresses_and_interface, finish_and_write, Finish};
use super::{
    endpoint_name, ipam_add, validate_endpoint_and_profile, veth_request, AddCx, CheckedReads,
    Record,
};
use crate::error::{AnnotationError, EmptyIpamAnswer, Result};
use crate::plugin::add::k8s::default_routes;
use crate::plugin::endpoint;
use crate::plugin::ipam::AddHints;
use crate::skel::CniResult;

pub async fn add(cx: &AddCx<'_>, made: &Record<'_>, answered: CheckedReads) -> Result<CniResult> {
    let (args, call) = (cx.args, cx.call);
    let conf = &call.conf;
    if conf.feature_control.ip_addrs_no_ipam {
        return Err(AnnotationError::FeatureUnsupported("ip_addrs_no_ipam").into());
    }
    if let Some(mut wep) = answered.existing {
        // Same container added again (or to a second network): record the profile, report
        // the addresses it has, touch nothing else.
        if !wep.spec.profiles.iter().any(|p| p == &conf.name) {
            info!(profile = %conf.name, "Calico CNI appending profile");
            wep.spec.profiles.push(conf.name.clone());
        }
        validate_endpoint_and_profile(&wep, answered.profile.as_ref())?;
        let result = endpoint::result_from_endpoint(&wep, &args.ifname, cx.result_mtu, &args.netns);
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
    validate_endpoint_and_profile(&wep, answered.profile.as_ref())?;

    let veth = veth_request(cx, &wep.spec.interface_name, None, call.plan.families);
    let ipam = ipam_add(
        cx,
        made,
        args,
        (answered.ipam, AddHints::default()),
        EmptyIpamAnswer::NoAddresses,
    );
    let result = addresses_and_interface(made, args, veth, ipam).await?;
    let finish = Finish {
        args,
        routes: default_routes(),
        mtu: cx.result_mtu,
        allow_ip_forwarding: conf.container_settings.allow_ip_forwarding,
        endpoint_write: call.plan.add.new_endpoint,
        floating_ips: Vec::new(),
        skip_host_routes: false,
        annotations: Default::default(),
    };
    finish_and_write(made, result, wep, finish).await
}
