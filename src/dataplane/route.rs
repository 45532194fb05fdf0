//! Host-side `/32` and `/128` routes to the pod (`SetupRoutes` upstream), including the
//! "route already exists" rules: the same route on the same link (e.g. already programmed by
//! Felix) is accepted; the destination on any other link is an error naming the owner.

use netlink_packet_route::route::RouteScope;
use rtnetlink::Handle;

use super::nl::{link_name_by_index, main_table_routes, nl_errno, route_message, scope_name};
use super::HostRouteError;
use crate::support::net::IpNet;

/// Adds `<ip>/32|/128 dev <host_veth> scope link proto boot` for every address. The caller
/// wraps a failure in `error adding host side routes for interface: ...`.
pub(crate) async fn setup_host_routes(
    h: &Handle,
    host_veth: &str,
    host_index: u32,
    ips: &[IpNet],
) -> Result<(), HostRouteError> {
    for ip in ips {
        let dst = IpNet::host(ip.addr);
        let msg = route_message(dst, None, host_index, RouteScope::Link);
        let err = match h.route().add(msg).execute().await {
            Ok(()) => {
                tracing::debug!(interface = host_veth, ip = %dst, "CNI adding route");
                continue;
            }
            Err(e) => e,
        };
        if nl_errno(&err) != Some(libc::EEXIST) {
            return Err(HostRouteError::Add {
                index: host_index,
                dst,
                iface: host_veth.to_string(),
                source: err,
            });
        }

        // The destination is taken. Fine if it is exactly our route on our link.
        let routes = main_table_routes(h, dst.is_ipv4())
            .await
            .map_err(HostRouteError::List)?;
        let ours = routes.iter().any(|r| {
            r.oif == host_index
                && r.dst.is_some_and(|d| d.addr == dst.addr)
                && r.scope == RouteScope::Link
        });
        if ours {
            // Upstream returns here, skipping the remaining addresses; we carry on so a
            // dual-stack pod still gets its other host route.
            tracing::info!(
                interface = host_veth,
                "CNI skipping add route. Route already exists"
            );
            continue;
        }

        // Report the first main-table route to the same address, with its interface name.
        let mut conflict = String::new();
        if let Some(r) = routes
            .iter()
            .find(|r| r.dst.is_some_and(|d| d.addr == dst.addr))
        {
            let name = link_name_by_index(h, r.oif)
                .await
                .unwrap_or_else(|| "unknown".to_string());
            let rdst = r.dst.map(|d| d.to_string()).unwrap_or_default();
            conflict = format!(
                "route (Ifindex: {}, Dst: {rdst}, Scope: {}, Iface: {name})",
                r.oif,
                scope_name(r.scope)
            );
        }
        return Err(HostRouteError::Conflict {
            index: host_index,
            dst,
            iface: host_veth.to_string(),
            conflict,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! These need root: they create a scratch netns with `ip netns add`.
    use super::*;
    use crate::dataplane::sys::{block_on, connect, open_netns, run_in_netns};
    use std::process::Command;

    fn ip(args: &[&str]) {
        let out = Command::new("ip").args(args).output().expect("run ip");
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    struct Scratch(String);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
        }
    }

    #[test]
    fn eexist_same_link_ok_other_link_error() {
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipping: needs root");
            return;
        }
        let name = format!("dp-route-unit-{}", std::process::id());
        ip(&["netns", "add", &name]);
        let _guard = Scratch(name.clone());
        ip(&[
            "-n",
            &name,
            "link",
            "add",
            "calitesta",
            "type",
            "veth",
            "peer",
            "name",
            "calitestb",
        ]);
        ip(&["-n", &name, "link", "set", "calitesta", "up"]);
        ip(&["-n", &name, "link", "set", "calitestb", "up"]);
        ip(&[
            "-n",
            &name,
            "route",
            "add",
            "10.65.0.5/32",
            "dev",
            "calitesta",
            "scope",
            "link",
        ]);

        let path = format!("/run/netns/{name}");
        let ns = open_netns(&path).unwrap();
        let (same, other, fresh, a_idx, b_idx) = run_in_netns(&ns, &path, || {
            block_on(async {
                let h = connect().unwrap();
                let a = crate::dataplane::nl::lookup(&h, "calitesta").await.unwrap();
                let b = crate::dataplane::nl::lookup(&h, "calitestb").await.unwrap();
                let (ai, bi) = (a.header.index, b.header.index);
                let ips: Vec<IpNet> = vec!["10.65.0.5/26".parse().unwrap()];
                let same = setup_host_routes(&h, "calitesta", ai, &ips).await;
                let other = setup_host_routes(&h, "calitestb", bi, &ips).await;
                // Same-link hit first, then a fresh address: the second one is still added.
                let two: Vec<IpNet> = vec![
                    "10.65.0.5/32".parse().unwrap(),
                    "10.65.0.6/32".parse().unwrap(),
                ];
                let fresh = setup_host_routes(&h, "calitesta", ai, &two).await;
                (same, other, fresh, ai, bi)
            })
            .unwrap()
        })
        .unwrap();
        assert!(same.is_ok(), "{same:?}");
        assert!(fresh.is_ok(), "{fresh:?}");
        assert_eq!(
            other.unwrap_err().to_string(),
            format!(
                "route (Ifindex: {b_idx}, Dst: 10.65.0.5/32, Scope: link) already exists for an \
                 interface other than 'calitestb': route (Ifindex: {a_idx}, Dst: 10.65.0.5/32, \
                 Scope: link, Iface: calitesta)"
            )
        );
        let out = Command::new("ip")
            .args(["-n", &name, "route", "show", "10.65.0.6"])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "10.65.0.6 dev calitesta scope link"
        );
    }
}
