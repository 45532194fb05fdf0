//! Makes a pod's interface fail after IPAM: a host route to the address the next pod will
//! be given, on another interface (`beside0`), so that the pod's own /32 route is refused.

#![allow(dead_code)]

use std::net::Ipv4Addr;

use serde_json::Value;

/// Routes the address after `ip` (in an affine block, the next pod's) to a new veth
/// `beside0` in the host netns, and returns it. `host_sh` runs a shell command there and
/// returns its stdout.
pub fn route_next_elsewhere(host_sh: impl Fn(&str) -> String, ip: Ipv4Addr) -> Ipv4Addr {
    let addr = Ipv4Addr::from(u32::from(ip) + 1);
    host_sh("ip link add beside0 type veth peer name beside1 && ip link set beside0 up");
    host_sh(&format!("ip route add {addr}/32 dev beside0 scope link"));
    let route = host_sh(&format!("ip route show {addr}"));
    assert!(route.contains("beside0"), "{route}");
    addr
}

/// Removes what `route_next_elsewhere` added.
pub fn unroute(host_sh: impl Fn(&str) -> String) {
    host_sh("ip link del beside0");
}

/// The CNI error an ADD gives when its host route to `addr` is refused.
pub fn assert_route_refused(err: &Value, addr: Ipv4Addr) {
    let msg = err["msg"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("Dst: {addr}/32"))
            && msg.contains("already exists for an interface other than"),
        "{err}"
    );
}
