//! The corpus: cases generated from dimensions (docs/differences.md says how it is read).
//! Every family below crosses a few dimensions; the ids say where each case sits:
//! `<store>/<family>/<dimension values>`.
//!
//! Pools are laid out so that both binaries pick the same addresses: the allocator walks
//! a pool's blocks from a seed made of the host name (both do it bit for bit), and a block's
//! addresses in order.

use serde_json::{json, Value};

use super::case::{By, Case, NetnsArg, PodSeed, Pool, Seed, Step, Store};

pub const VERSIONS: [&str; 6] = ["0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0"];
pub const STORES: [Store; 2] = [Store::Etcd, Store::Kdd];
const NET: &str = "k8s-pod-network";
const NS: &str = "default";
const POD: &str = "pod1";
const CID: &str = "c0ffee000001";
const CID2: &str = "c0ffee000002";
pub const V6_POOL: &str = "fd80:24e2:f998:72d6::/64";

/// IP families a case asks for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
    Dual,
}

impl Family {
    fn name(self) -> &'static str {
        match self {
            Family::V4 => "v4",
            Family::V6 => "v6",
            Family::Dual => "dual",
        }
    }
}

/// Who the container belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Orch {
    /// A Kubernetes pod (K8S_POD_* in CNI_ARGS), with policy type k8s.
    K8s,
    /// Any other container, no policy type (the plugin writes a Profile on etcd).
    Cni,
}

/// The base of a case's NetConf: the manifests' calico entry (calico.yaml on the
/// Kubernetes datastore, calico-etcd.yaml's on etcd, which leaves the node name to the
/// nodename file).
pub fn base_conf(store: Store, version: &str, orch: Orch) -> Value {
    let mut c = json!({
        "cniVersion": version,
        "name": NET,
        "type": "calico",
        "log_level": "info",
        "log_file_path": "/var/log/calico/cni/cni.log",
        "mtu": 0,
        "ipam": {"type": "calico-ipam"},
        "kubernetes": {"kubeconfig": "/etc/cni/net.d/calico-kubeconfig"},
    });
    match store {
        Store::Etcd => c["etcd_endpoints"] = json!("{etcd}"),
        Store::Kdd => {
            c["datastore_type"] = json!("kubernetes");
            c["nodename"] = json!("node1");
        }
    }
    if orch == Orch::K8s {
        c["policy"] = json!({"type": "k8s"});
    }
    c
}

/// `base` with `extra` merged in (objects recursively; `null` removes a key).
pub fn with(mut base: Value, extra: Value) -> Value {
    crate::common::world::merge(&mut base, extra);
    base
}

/// The `ipam` section for `family` with `ipam` (`calico-ipam` or `host-local`).
fn ipam_for(ipam: &str, family: Family) -> Value {
    match (ipam, family) {
        ("calico-ipam", Family::V4) => json!({"type": "calico-ipam"}),
        ("calico-ipam", Family::V6) => {
            json!({"type": "calico-ipam", "assign_ipv4": "false", "assign_ipv6": "true"})
        }
        ("calico-ipam", Family::Dual) => {
            json!({"type": "calico-ipam", "assign_ipv4": "true", "assign_ipv6": "true"})
        }
        (_, Family::V4) => json!({"type": "host-local", "subnet": "10.66.0.0/24"}),
        (_, Family::V6) => json!({"type": "host-local", "ranges": [[{"subnet": "fd00:66::/120"}]]}),
        (_, Family::Dual) => json!({"type": "host-local",
            "ranges": [[{"subnet": "10.66.0.0/24"}], [{"subnet": "fd00:66::/120"}]]}),
    }
}

fn k8s_args(cid: &str) -> String {
    format!("K8S_POD_NAMESPACE={NS};K8S_POD_NAME={POD};K8S_POD_INFRA_CONTAINER_ID={cid}")
}

fn step(command: &str, cid: &str, orch: Orch, conf: &Value) -> Step {
    Step {
        by: By::Subject,
        plugin: "calico".into(),
        command: command.into(),
        container_id: cid.into(),
        netns: NetnsArg::Pod(0),
        ifname: "eth0".into(),
        cni_args: match orch {
            Orch::K8s => k8s_args(cid),
            Orch::Cni => String::new(),
        },
        conf: conf.clone(),
        raw_stdin: None,
        prev_result: command != "ADD",
        argv: vec![],
        env: vec![],
    }
}

fn ipam_step(command: &str, cid: &str, orch: Orch, conf: &Value) -> Step {
    let mut s = step(command, cid, orch, conf);
    s.plugin = "calico-ipam".into();
    s.prev_result = false;
    s
}

fn pod(labels: Value, annotations: Value) -> PodSeed {
    PodSeed {
        namespace: NS.into(),
        name: POD.into(),
        labels,
        annotations,
        extra: Value::Null,
    }
}

fn seed_for(family: Family, orch: Orch) -> Seed {
    let mut seed = Seed::default();
    if family != Family::V4 {
        seed.pools
            .push(Pool::new("default-ipv6-ippool", V6_POOL, 122));
    }
    if orch == Orch::K8s {
        seed.pods.push(pod(json!({"app": "web"}), Value::Null));
    }
    seed
}

fn case(id: String, store: Store, seed: Seed, steps: Vec<Step>) -> Case {
    let pod_netns = steps
        .iter()
        .filter_map(|s| match s.netns {
            NetnsArg::Pod(i) => Some(i + 1),
            NetnsArg::Literal(_) => None,
        })
        .max()
        .unwrap_or(0);
    Case {
        id,
        store,
        seed,
        pod_netns,
        steps,
    }
}

/// Every case.
pub fn corpus() -> Vec<Case> {
    let mut all = Vec::new();
    lifecycle(&mut all);
    ipam_alone(&mut all);
    pools(&mut all);
    ip_arg(&mut all);
    annotations(&mut all);
    bad_netconf(&mut all);
    world_states(&mut all);
    sequences(&mut all);
    version(&mut all);
    mtu_files(&mut all);
    routes_and_settings(&mut all);
    grpc_dataplane(&mut all);
    ipam_upgrade(&mut all);
    kubevirt(&mut all);
    mixed(&mut all);
    all
}

/// ADD, CHECK, DEL, DEL at every version, with each IPAM, family and orchestrator.
fn lifecycle(all: &mut Vec<Case>) {
    for store in STORES {
        for version in VERSIONS {
            for ipam in ["calico-ipam", "host-local"] {
                for family in [Family::V4, Family::V6, Family::Dual] {
                    for (orch, policy) in
                        [(Orch::K8s, true), (Orch::Cni, false), (Orch::K8s, false)]
                    {
                        // Plain CNI containers on the Kubernetes datastore (which stores
                        // only pods' endpoints), and pods without policy type k8s: at two
                        // versions.
                        let rare = orch == Orch::Cni && store == Store::Kdd
                            || orch == Orch::K8s && !policy;
                        if rare && !["0.3.1", "1.0.0"].contains(&version) {
                            continue;
                        }
                        let mut conf = with(
                            base_conf(store, version, orch),
                            json!({"ipam": ipam_for(ipam, family)}),
                        );
                        if !policy {
                            conf = with(conf, json!({"policy": null}));
                        }
                        let orch_name = match (orch, policy) {
                            (Orch::K8s, true) => "k8s",
                            (Orch::K8s, false) => "k8s-no-policy",
                            _ => "cni",
                        };
                        all.push(case(
                            format!(
                                "{}/lifecycle/{version}/{ipam}/{}/{orch_name}",
                                store.name(),
                                family.name()
                            ),
                            store,
                            seed_for(family, orch),
                            vec![
                                step("ADD", CID, orch, &conf),
                                step("CHECK", CID, orch, &conf),
                                step("DEL", CID, orch, &conf),
                                step("DEL", CID, orch, &conf),
                            ],
                        ));
                    }
                }
            }
        }
    }
}

/// calico-ipam called alone, as another plugin (or a runtime) would.
fn ipam_alone(all: &mut Vec<Case>) {
    for store in STORES {
        for version in VERSIONS {
            for family in [Family::V4, Family::V6, Family::Dual] {
                if family != Family::V4 && !["0.3.1", "1.0.0"].contains(&version) {
                    continue;
                }
                let conf = with(
                    base_conf(store, version, Orch::Cni),
                    json!({"ipam": ipam_for("calico-ipam", family)}),
                );
                all.push(case(
                    format!("{}/ipam-alone/{version}/{}", store.name(), family.name()),
                    store,
                    seed_for(family, Orch::Cni),
                    vec![
                        ipam_step("ADD", CID, Orch::Cni, &conf),
                        ipam_step("CHECK", CID, Orch::Cni, &conf),
                        ipam_step("DEL", CID, Orch::Cni, &conf),
                        ipam_step("DEL", CID, Orch::Cni, &conf),
                    ],
                ));
            }
        }
        // With a pod's arguments (as calico passes them on).
        let conf = base_conf(store, "0.3.1", Orch::K8s);
        let mut add = ipam_step("ADD", CID, Orch::K8s, &conf);
        add.cni_args = format!("IgnoreUnknown=1;{}", k8s_args(CID));
        let mut del = add.clone();
        del.command = "DEL".into();
        all.push(case(
            format!("{}/ipam-alone/k8s-args", store.name()),
            store,
            seed_for(Family::V4, Orch::K8s),
            vec![add, del],
        ));
    }
}

/// Pools chosen by the NetConf: by name, by CIDR, unknown, disabled, exhausted.
fn pools(all: &mut Vec<Case>) {
    let two_pools = || {
        let mut s = seed_for(Family::Dual, Orch::K8s);
        s.pools
            .push(Pool::new("second-ipv4-ippool", "10.70.0.0/16", 26));
        s
    };
    type MakeSeed = Box<dyn Fn() -> Seed>;
    let variants: Vec<(&str, Value, MakeSeed)> = vec![
        (
            "v4-by-name",
            json!({"ipv4_pools": ["second-ipv4-ippool"]}),
            Box::new(two_pools),
        ),
        (
            "v4-by-cidr",
            json!({"ipv4_pools": ["10.70.0.0/16"]}),
            Box::new(two_pools),
        ),
        (
            "v4-unknown-name",
            json!({"ipv4_pools": ["no-such-pool"]}),
            Box::new(two_pools),
        ),
        (
            "v4-unknown-cidr",
            json!({"ipv4_pools": ["10.99.0.0/16"]}),
            Box::new(two_pools),
        ),
        (
            "v4-not-a-cidr",
            json!({"ipv4_pools": ["10.99.0.0/33"]}),
            Box::new(two_pools),
        ),
        (
            "v6-by-name",
            json!({"assign_ipv6": "true", "ipv6_pools": ["default-ipv6-ippool"]}),
            Box::new(two_pools),
        ),
        (
            "v6-by-cidr",
            json!({"assign_ipv6": "true", "ipv6_pools": [V6_POOL]}),
            Box::new(two_pools),
        ),
        (
            "v6-unknown",
            json!({"assign_ipv6": "true", "ipv6_pools": ["fd00:99::/64"]}),
            Box::new(two_pools),
        ),
        (
            "v4-pool-as-v6",
            json!({"assign_ipv6": "true", "ipv6_pools": ["default-ipv4-ippool"]}),
            Box::new(two_pools),
        ),
        (
            "dual-no-v6-pool",
            json!({"assign_ipv6": "true"}),
            Box::new(|| seed_for(Family::V4, Orch::K8s)),
        ),
        (
            "v6-only-no-v6-pool",
            json!({"assign_ipv4": "false", "assign_ipv6": "true"}),
            Box::new(|| seed_for(Family::V4, Orch::K8s)),
        ),
        (
            "none-assigned",
            json!({"assign_ipv4": "false", "assign_ipv6": "false"}),
            Box::new(|| seed_for(Family::V4, Orch::K8s)),
        ),
        (
            "disabled-pool",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools[0].disabled = true;
                s
            }),
        ),
        (
            "disabled-pool-by-name",
            json!({"ipv4_pools": ["default-ipv4-ippool"]}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools[0].disabled = true;
                s
            }),
        ),
        (
            "no-pools",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools.clear();
                s
            }),
        ),
        (
            "exhausted-by-reservation",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools = vec![Pool::new("small-ippool", "10.80.0.0/30", 30)];
                s.reservations = vec![("all-of-it".into(), vec!["10.80.0.0/30".into()])];
                s
            }),
        ),
        (
            "partly-reserved",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools = vec![Pool::new("small-ippool", "10.80.0.0/30", 30)];
                s.reservations = vec![("first-two".into(), vec!["10.80.0.0/31".into()])];
                s
            }),
        ),
        (
            "node-selector-other-node",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools[0].node_selector = "kubernetes.io/hostname == 'node2'".into();
                s
            }),
        ),
        (
            "node-selector-this-node",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools[0].node_selector = "kubernetes.io/hostname == 'node1'".into();
                s
            }),
        ),
        // (/32 blocks are walked from a time-seeded start, by both: not comparable.)
        (
            "block-size-31",
            json!({}),
            Box::new(|| {
                let mut s = seed_for(Family::V4, Orch::K8s);
                s.pools = vec![Pool::new("tiny-blocks", "10.81.0.0/28", 31)];
                s
            }),
        ),
    ];
    for store in STORES {
        for (name, ipam, seed) in &variants {
            let conf = with(base_conf(store, "1.0.0", Orch::K8s), json!({"ipam": ipam}));
            all.push(case(
                format!("{}/pools/{name}", store.name()),
                store,
                seed(),
                vec![
                    step("ADD", CID, Orch::K8s, &conf),
                    step("DEL", CID, Orch::K8s, &conf),
                ],
            ));
        }
        // An exhausted pool: the second pod finds no address.
        let mut seed = seed_for(Family::V4, Orch::K8s);
        seed.pools = vec![Pool::new("one-address", "10.82.0.0/32", 32)];
        let mut second = pod(json!({"app": "web"}), Value::Null);
        second.name = "pod2".into();
        seed.pods.push(second);
        let conf = base_conf(store, "1.0.0", Orch::K8s);
        let mut add2 = step("ADD", CID2, Orch::K8s, &conf);
        add2.cni_args =
            format!("K8S_POD_NAMESPACE={NS};K8S_POD_NAME=pod2;K8S_POD_INFRA_CONTAINER_ID={CID2}");
        add2.netns = NetnsArg::Pod(1);
        let mut del2 = add2.clone();
        del2.command = "DEL".into();
        all.push(case(
            format!("{}/pools/exhausted", store.name()),
            store,
            seed,
            vec![
                step("ADD", CID, Orch::K8s, &conf),
                add2,
                del2,
                step("DEL", CID, Orch::K8s, &conf),
            ],
        ));
    }
}

/// `IP=` in CNI_ARGS (calico-ipam's AssignIP).
fn ip_arg(all: &mut Vec<Case>) {
    for store in STORES {
        for (name, ip, family) in [
            ("v4-in-pool", "10.65.1.7", Family::V4),
            ("v4-outside-pools", "10.99.0.7", Family::V4),
            ("v4-not-an-ip", "10.65.1.x", Family::V4),
            ("v6-in-pool", "fd80:24e2:f998:72d6::7", Family::V6),
            (
                "v4-and-v6",
                "10.65.1.7,fd80:24e2:f998:72d6::7",
                Family::Dual,
            ),
        ] {
            for plugin in ["calico", "calico-ipam"] {
                let conf = with(
                    base_conf(store, "0.3.1", Orch::K8s),
                    json!({"ipam": ipam_for("calico-ipam", family)}),
                );
                let mut add = if plugin == "calico" {
                    step("ADD", CID, Orch::K8s, &conf)
                } else {
                    ipam_step("ADD", CID, Orch::K8s, &conf)
                };
                add.cni_args = format!("{};IP={ip}", add.cni_args);
                let mut del = add.clone();
                del.command = "DEL".into();
                all.push(case(
                    format!("{}/ip-arg/{plugin}/{name}", store.name()),
                    store,
                    seed_for(family, Orch::K8s),
                    vec![add, del],
                ));
            }
        }
        // The address another container holds.
        let conf = base_conf(store, "0.3.1", Orch::K8s);
        let mut first = step("ADD", CID, Orch::K8s, &conf);
        first.cni_args = format!("{};IP=10.65.1.7", first.cni_args);
        let mut second = step(
            "ADD",
            CID2,
            Orch::Cni,
            &base_conf(store, "0.3.1", Orch::Cni),
        );
        second.cni_args = "IP=10.65.1.7".into();
        second.netns = NetnsArg::Pod(1);
        all.push(case(
            format!("{}/ip-arg/taken", store.name()),
            store,
            seed_for(Family::V4, Orch::K8s),
            vec![first, second],
        ));
    }
}

/// Every pod (and namespace) annotation upstream reads, in good and bad forms.
fn annotations(all: &mut Vec<Case>) {
    let pool_ann = |v: &str| json!({"cni.projectcalico.org/ipv4pools": v});
    let v6_ann = |v: &str| json!({"cni.projectcalico.org/ipv6pools": v});
    let fam = |v: &str| json!({"cni.projectcalico.org/ipFamilies": v});
    let addrs = |v: &str| json!({"cni.projectcalico.org/ipAddrs": v});
    let noipam = |v: &str| json!({"cni.projectcalico.org/ipAddrsNoIpam": v});
    let fips = |v: &str| json!({"cni.projectcalico.org/floatingIPs": v});
    let hw = |v: &str| json!({"cni.projectcalico.org/hwAddr": v});
    let asp = |v: &str| json!({"cni.projectcalico.org/allowedSourcePrefixes": v});
    let both_features =
        json!({"feature_control": {"floating_ips": true, "ip_addrs_no_ipam": true}});
    let none = json!({});
    let dual_ipam = json!({"ipam": {"assign_ipv6": "true"}});
    // (name, pod annotations, extra conf)
    let variants: Vec<(&str, Value, Value)> = vec![
        (
            "ipv4pools-name",
            pool_ann(r#"["second-ipv4-ippool"]"#),
            none.clone(),
        ),
        (
            "ipv4pools-cidr",
            pool_ann(r#"["10.70.0.0/16"]"#),
            none.clone(),
        ),
        ("ipv4pools-unknown", pool_ann(r#"["nope"]"#), none.clone()),
        (
            "ipv4pools-not-json",
            pool_ann("second-ipv4-ippool"),
            none.clone(),
        ),
        ("ipv4pools-not-a-list", pool_ann(r#"{"a":1}"#), none.clone()),
        ("ipv4pools-empty-list", pool_ann("[]"), none.clone()),
        (
            "ipv6pools-name",
            v6_ann(r#"["default-ipv6-ippool"]"#),
            dual_ipam.clone(),
        ),
        ("ipv6pools-not-json", v6_ann("x"), dual_ipam.clone()),
        ("ipFamilies-v6", fam(r#"["IPv6"]"#), none.clone()),
        ("ipFamilies-dual", fam(r#"["IPv4","IPv6"]"#), none.clone()),
        ("ipFamilies-bad-family", fam(r#"["IPv5"]"#), none.clone()),
        ("ipFamilies-not-json", fam("IPv4"), none.clone()),
        ("ipAddrs-v4", addrs(r#"["10.65.3.9"]"#), none.clone()),
        (
            "ipAddrs-dual",
            addrs(r#"["10.65.3.9","fd80:24e2:f998:72d6::9"]"#),
            none.clone(),
        ),
        (
            "ipAddrs-outside-pools",
            addrs(r#"["10.99.3.9"]"#),
            none.clone(),
        ),
        ("ipAddrs-not-an-ip", addrs(r#"["10.65.3.x"]"#), none.clone()),
        ("ipAddrs-not-json", addrs("10.65.3.9"), none.clone()),
        (
            "ipAddrs-two-v4",
            addrs(r#"["10.65.3.9","10.65.3.10"]"#),
            none.clone(),
        ),
        (
            "ipAddrsNoIpam-disabled",
            noipam(r#"["10.99.3.9"]"#),
            none.clone(),
        ),
        (
            "ipAddrsNoIpam-v4",
            noipam(r#"["10.99.3.9"]"#),
            both_features.clone(),
        ),
        (
            "ipAddrsNoIpam-cidr",
            noipam(r#"["10.99.3.0/30"]"#),
            both_features.clone(),
        ),
        (
            "ipAddrsNoIpam-not-json",
            noipam("10.99.3.9"),
            both_features.clone(),
        ),
        (
            "ipAddrs-and-ipAddrsNoIpam",
            json!({"cni.projectcalico.org/ipAddrs": r#"["10.65.3.9"]"#, "cni.projectcalico.org/ipAddrsNoIpam": r#"["10.99.3.9"]"#}),
            both_features.clone(),
        ),
        ("floatingIPs-disabled", fips(r#"["1.2.3.4"]"#), none.clone()),
        (
            "floatingIPs-v4",
            fips(r#"["1.2.3.4"]"#),
            both_features.clone(),
        ),
        (
            "floatingIPs-cidr",
            fips(r#"["1.2.3.4/32"]"#),
            both_features.clone(),
        ),
        (
            "floatingIPs-not-an-ip",
            fips(r#"["foo"]"#),
            both_features.clone(),
        ),
        (
            "floatingIPs-v6-without-v6",
            fips(r#"["fd00::4"]"#),
            both_features.clone(),
        ),
        (
            "floatingIPs-not-json",
            fips("1.2.3.4"),
            both_features.clone(),
        ),
        ("hwAddr-good", hw("aa:bb:cc:dd:ee:01"), none.clone()),
        ("hwAddr-upper", hw("AA:BB:CC:DD:EE:02"), none.clone()),
        ("hwAddr-dashes", hw("aa-bb-cc-dd-ee-03"), none.clone()),
        ("hwAddr-dots", hw("aabb.ccdd.ee04"), none.clone()),
        ("hwAddr-bad", hw("zz"), none.clone()),
        ("hwAddr-empty", hw(""), none.clone()),
        (
            "allowedSourcePrefixes-good",
            asp(r#"["10.0.0.0/8"]"#),
            none.clone(),
        ),
        (
            "allowedSourcePrefixes-ip",
            asp(r#"["10.0.0.1"]"#),
            none.clone(),
        ),
        ("allowedSourcePrefixes-bad", asp(r#"["bad"]"#), none.clone()),
        (
            "allowedSourcePrefixes-not-json",
            asp("10.0.0.0/8"),
            none.clone(),
        ),
    ];
    for store in STORES {
        for (name, ann, extra) in &variants {
            let mut seed = seed_for(Family::Dual, Orch::K8s);
            seed.pools
                .push(Pool::new("second-ipv4-ippool", "10.70.0.0/16", 26));
            seed.pods = vec![pod(json!({"app": "web"}), ann.clone())];
            let conf = with(base_conf(store, "1.0.0", Orch::K8s), extra.clone());
            all.push(case(
                format!("{}/annotations/{name}", store.name()),
                store,
                seed,
                vec![
                    step("ADD", CID, Orch::K8s, &conf),
                    step("DEL", CID, Orch::K8s, &conf),
                ],
            ));
        }
        // Floating IPs on a re-ADD (upstream appends the NATs again on etcd).
        let mut seed = seed_for(Family::V4, Orch::K8s);
        seed.pods = vec![pod(json!({"app": "web"}), fips(r#"["1.2.3.4"]"#))];
        let conf = with(base_conf(store, "1.0.0", Orch::K8s), both_features.clone());
        all.push(case(
            format!("{}/annotations/floatingIPs-v4-re-add", store.name()),
            store,
            seed,
            vec![
                step("ADD", CID, Orch::K8s, &conf),
                step("ADD", CID, Orch::K8s, &conf),
                step("DEL", CID, Orch::K8s, &conf),
            ],
        ));
        // Pools from the namespace, and the pod's over the namespace's.
        for (name, pod_ann) in [
            ("namespace-pools", Value::Null),
            (
                "pod-over-namespace-pools",
                pool_ann(r#"["default-ipv4-ippool"]"#),
            ),
        ] {
            let mut seed = seed_for(Family::V4, Orch::K8s);
            seed.pools
                .push(Pool::new("second-ipv4-ippool", "10.70.0.0/16", 26));
            seed.namespaces[0].annotations = pool_ann(r#"["second-ipv4-ippool"]"#);
            seed.pods = vec![pod(json!({"app": "web"}), pod_ann)];
            let conf = base_conf(store, "1.0.0", Orch::K8s);
            all.push(case(
                format!("{}/annotations/{name}", store.name()),
                store,
                seed,
                vec![
                    step("ADD", CID, Orch::K8s, &conf),
                    step("DEL", CID, Orch::K8s, &conf),
                ],
            ));
        }
        // Labels and service account become the endpoint's; namespace labels its profile.
        let mut seed = seed_for(Family::V4, Orch::K8s);
        seed.namespaces[0].labels = json!({"team": "blue"});
        seed.pods = vec![pod(json!({"app": "web", "tier": "front"}), Value::Null)];
        let conf = base_conf(store, "1.0.0", Orch::K8s);
        all.push(case(
            format!("{}/annotations/labels", store.name()),
            store,
            seed,
            vec![
                step("ADD", CID, Orch::K8s, &conf),
                step("DEL", CID, Orch::K8s, &conf),
            ],
        ));
    }
}

/// A bad value for every NetConf field, and JSON that is not a NetConf at all.
fn bad_netconf(all: &mut Vec<Case>) {
    let variants: Vec<(&str, Value)> = vec![
        ("name-missing", json!({"name": null})),
        ("name-number", json!({"name": 5})),
        ("cniVersion-number", json!({"cniVersion": 5})),
        ("cniVersion-unknown", json!({"cniVersion": "9.9.9"})),
        ("cniVersion-empty", json!({"cniVersion": ""})),
        ("type-missing", json!({"type": null})),
        ("ipam-missing", json!({"ipam": null})),
        ("ipam-type-missing", json!({"ipam": {"type": null}})),
        (
            "ipam-type-unknown",
            json!({"ipam": {"type": "no-such-ipam"}}),
        ),
        ("ipam-type-number", json!({"ipam": {"type": 7}})),
        ("ipam-not-object", json!({"ipam": "calico-ipam"})),
        ("assign_ipv4-bool", json!({"ipam": {"assign_ipv4": true}})),
        ("assign_ipv4-bad", json!({"ipam": {"assign_ipv4": "maybe"}})),
        (
            "ipv4_pools-string",
            json!({"ipam": {"ipv4_pools": "default-ipv4-ippool"}}),
        ),
        ("mtu-string", json!({"mtu": "1500"})),
        ("mtu-negative", json!({"mtu": -1})),
        ("mtu-huge", json!({"mtu": 100000})),
        ("mtu-small", json!({"mtu": 500})),
        ("mtu-9000", json!({"mtu": 9000})),
        ("num_queues-string", json!({"num_queues": "2"})),
        ("num_queues-2", json!({"num_queues": 2})),
        ("num_queues-huge", json!({"num_queues": 100000})),
        ("log_level-bad", json!({"log_level": "loud"})),
        ("log_level-number", json!({"log_level": 3})),
        (
            "log_file_max_size-string",
            json!({"log_file_max_size": "10"}),
        ),
        ("policy-type-bogus", json!({"policy": {"type": "bogus"}})),
        ("policy-not-object", json!({"policy": "k8s"})),
        ("datastore_type-bogus", json!({"datastore_type": "bogus"})),
        ("datastore_type-number", json!({"datastore_type": 1})),
        ("etcd_endpoints-number", json!({"etcd_endpoints": 1})),
        (
            "kubeconfig-missing-file",
            json!({"kubernetes": {"kubeconfig": "/etc/cni/net.d/nope"}}),
        ),
        (
            "kubeconfig-number",
            json!({"kubernetes": {"kubeconfig": 1}}),
        ),
        ("nodename-number", json!({"nodename": 1})),
        (
            "nodename_file_optional-string",
            json!({"nodename_file_optional": "yes"}),
        ),
        (
            "container_settings-string",
            json!({"container_settings": "x"}),
        ),
        (
            "allow_ip_forwarding-string",
            json!({"container_settings": {"allow_ip_forwarding": "true"}}),
        ),
        (
            "allow_ip_forwarding-true",
            json!({"container_settings": {"allow_ip_forwarding": true}}),
        ),
        ("feature_control-string", json!({"feature_control": "x"})),
        (
            "dataplane_options-unknown",
            json!({"dataplane_options": {"type": "bogus"}}),
        ),
        (
            "dataplane_options-grpc-no-socket",
            json!({"dataplane_options": {"type": "grpc"}}),
        ),
        (
            "dataplane_options-type-number",
            json!({"dataplane_options": {"type": 5}}),
        ),
        (
            "readiness_gates-bad-url",
            json!({"readiness_gates": ["::bad"]}),
        ),
        (
            "readiness_gates-string",
            json!({"readiness_gates": "http://x"}),
        ),
        (
            "policy_setup_timeout-negative",
            json!({"policy_setup_timeout_seconds": -1}),
        ),
        (
            "policy_setup_timeout-string",
            json!({"policy_setup_timeout_seconds": "1"}),
        ),
        (
            "include_default_routes-string",
            json!({"include_default_routes": "true"}),
        ),
        ("require_mtu_file-true", json!({"require_mtu_file": true})),
        (
            "etcd_ca_cert_file-missing",
            json!({"etcd_ca_cert_file": "/etc/cni/net.d/nope.pem"}),
        ),
        ("qps-string", json!({"qps": "x"})),
        ("unknown-field", json!({"no_such_field": {"a": 1}})),
        // A pod without policy type k8s: the API client is still made, the pod not read.
        ("k8s-args-no-policy", json!({"policy": null})),
        (
            "k8s-args-no-policy-no-kubeconfig",
            json!({"policy": null, "kubernetes": null}),
        ),
        (
            "k8s-args-no-policy-kubeconfig-missing-file",
            json!({"policy": null, "kubernetes": {"kubeconfig": "/etc/cni/net.d/nope"}}),
        ),
        (
            "keys-in-other-case",
            json!({"MTU": 1400, "Log_Level": "debug"}),
        ),
    ];
    for store in STORES {
        for (name, extra) in &variants {
            let conf = with(base_conf(store, "1.0.0", Orch::K8s), extra.clone());
            let mut del = step("DEL", CID, Orch::K8s, &conf);
            del.prev_result = false;
            all.push(case(
                format!("{}/netconf/{name}", store.name()),
                store,
                seed_for(Family::V4, Orch::K8s),
                vec![step("ADD", CID, Orch::K8s, &conf), del],
            ));
        }
        for (name, raw) in [
            ("json-malformed", r#"{"cniVersion":"1.0.0", nope}"#),
            ("json-empty", ""),
            ("json-array", "[1,2]"),
            ("json-truncated", r#"{"cniVersion":"1.0.0","name":"x""#),
        ] {
            let conf = base_conf(store, "1.0.0", Orch::K8s);
            let mut add = step("ADD", CID, Orch::K8s, &conf);
            add.raw_stdin = Some(raw.into());
            let mut ipam = ipam_step("ADD", CID, Orch::K8s, &conf);
            ipam.raw_stdin = Some(raw.into());
            all.push(case(
                format!("{}/netconf/{name}", store.name()),
                store,
                seed_for(Family::V4, Orch::K8s),
                vec![add, ipam],
            ));
        }
    }
}

/// A world that is not ready: no pod, namespace, Node, ClusterInformation, nodename file.
fn world_states(all: &mut Vec<Case>) {
    type Change = fn(&mut Seed);
    let variants: Vec<(&str, Change)> = vec![
        ("no-pod", |s| s.pods.clear()),
        ("no-namespace", |s| s.pods.clear()),
        ("no-node", |s| s.node = false),
        ("cluster-not-ready", |s| s.cluster_ready = Some(false)),
        ("no-cluster-information", |s| s.cluster_ready = None),
        ("no-nodename-file", |s| s.nodename_file = false),
    ];
    for store in STORES {
        for (name, change) in &variants {
            for orch in [Orch::K8s, Orch::Cni] {
                if orch == Orch::Cni
                    && (name.starts_with("no-pod") || name.starts_with("no-namespace"))
                {
                    continue;
                }
                let mut seed = seed_for(Family::V4, orch);
                change(&mut seed);
                let mut conf = base_conf(store, "1.0.0", orch);
                if *name == "no-nodename-file" {
                    conf = with(conf, json!({"nodename": null}));
                }
                let mut add = step("ADD", CID, orch, &conf);
                let mut del = step("DEL", CID, orch, &conf);
                del.prev_result = false;
                if *name == "no-namespace" {
                    add.cni_args = add
                        .cni_args
                        .replace("K8S_POD_NAMESPACE=default", "K8S_POD_NAMESPACE=missing-ns");
                    del.cni_args = add.cni_args.clone();
                }
                let orch_name = if orch == Orch::K8s { "k8s" } else { "cni" };
                all.push(case(
                    format!("{}/world/{name}/{orch_name}", store.name()),
                    store,
                    seed,
                    vec![add, del],
                ));
            }
        }
    }
}

/// Calls in the orders runtimes make them: re-ADD, DEL twice, DEL first, DEL without a
/// netns, a stale sandbox's DEL, a second interface.
fn sequences(all: &mut Vec<Case>) {
    for store in STORES {
        for orch in [Orch::K8s, Orch::Cni] {
            let orch_name = if orch == Orch::K8s { "k8s" } else { "cni" };
            let conf = base_conf(store, "0.3.1", orch);
            let id = |what: &str| format!("{}/sequence/{what}/{orch_name}", store.name());
            let seed = || seed_for(Family::V4, orch);
            let add = step("ADD", CID, orch, &conf);
            let del = step("DEL", CID, orch, &conf);
            all.push(case(
                id("re-add"),
                store,
                seed(),
                vec![add.clone(), add.clone(), del.clone()],
            ));
            all.push(case(
                id("del-first"),
                store,
                seed(),
                vec![del.clone(), add.clone(), del.clone()],
            ));
            let mut del_no_netns = del.clone();
            del_no_netns.netns = NetnsArg::Literal(String::new());
            all.push(case(
                id("del-without-netns"),
                store,
                seed(),
                vec![add.clone(), del_no_netns.clone(), del.clone()],
            ));
            let mut del_gone_netns = del.clone();
            del_gone_netns.netns = NetnsArg::Literal("/var/run/netns/gone".into());
            all.push(case(
                id("del-netns-gone"),
                store,
                seed(),
                vec![add.clone(), del_gone_netns],
            ));
            let mut check_after_del = step(
                "CHECK",
                CID,
                orch,
                &with(conf.clone(), json!({"cniVersion": "1.0.0"})),
            );
            check_after_del.prev_result = true;
            all.push(case(
                id("check-after-del"),
                store,
                seed(),
                vec![
                    with_version(&add, "1.0.0"),
                    with_version(&del, "1.0.0"),
                    check_after_del,
                ],
            ));
            let mut eth1 = add.clone();
            eth1.ifname = "eth1".into();
            let mut del1 = del.clone();
            del1.ifname = "eth1".into();
            all.push(case(
                id("second-interface"),
                store,
                seed(),
                vec![add.clone(), eth1, del1, del.clone()],
            ));
            // A newer sandbox of the same pod (or container name) runs; the old one's DEL.
            let mut add_new = step("ADD", CID2, orch, &conf);
            add_new.netns = NetnsArg::Pod(1);
            let mut del_new = step("DEL", CID2, orch, &conf);
            del_new.netns = NetnsArg::Pod(1);
            all.push(case(
                id("stale-sandbox-del"),
                store,
                seed(),
                vec![add.clone(), add_new.clone(), del.clone(), del_new.clone()],
            ));
            let mut stale_no_netns = del.clone();
            stale_no_netns.netns = NetnsArg::Literal(String::new());
            all.push(case(
                id("stale-sandbox-del-without-netns"),
                store,
                seed(),
                vec![
                    add.clone(),
                    add_new.clone(),
                    stale_no_netns,
                    del_new.clone(),
                ],
            ));
            // A DEL whose datastore refuses it (a wrong token): nothing is removed; the
            // retried DEL removes it all. (An etcd that does not answer holds upstream's DEL
            // for minutes, docs/deadline.md: not a case.)
            if store == Store::Kdd {
                let refused = with(
                    conf.clone(),
                    json!({"kubernetes": {"kubeconfig": "/etc/cni/net.d/bad-kubeconfig"}}),
                );
                let mut del_refused = step("DEL", CID, orch, &refused);
                del_refused.prev_result = false;
                all.push(case(
                    id("del-refused"),
                    store,
                    seed(),
                    vec![add.clone(), del_refused.clone(), del.clone()],
                ));
                all.push(case(
                    id("stale-sandbox-del-refused"),
                    store,
                    seed(),
                    vec![
                        add.clone(),
                        add_new.clone(),
                        del_refused,
                        del.clone(),
                        del_new.clone(),
                    ],
                ));
            }
            // A DEL with another network's name.
            let other = with(conf.clone(), json!({"name": "other-net"}));
            all.push(case(
                id("del-other-network"),
                store,
                seed(),
                vec![add.clone(), step("DEL", CID, orch, &other), del.clone()],
            ));
        }
    }
}

fn with_version(s: &Step, version: &str) -> Step {
    let mut s = s.clone();
    s.conf["cniVersion"] = json!(version);
    s
}

/// VERSION of both plugins, whatever the config says.
fn version(all: &mut Vec<Case>) {
    for plugin in ["calico", "calico-ipam"] {
        for (name, stdin) in [
            ("none", None),
            ("0.1.0", Some(r#"{"cniVersion":"0.1.0"}"#)),
            ("0.4.0", Some(r#"{"cniVersion":"0.4.0"}"#)),
            ("1.0.0", Some(r#"{"cniVersion":"1.0.0"}"#)),
            ("1.1.0", Some(r#"{"cniVersion":"1.1.0"}"#)),
            ("9.9.9", Some(r#"{"cniVersion":"9.9.9"}"#)),
            ("malformed", Some("{nope")),
            ("empty-object", Some("{}")),
        ] {
            let conf = base_conf(Store::Etcd, "1.0.0", Orch::Cni);
            let mut s = step("VERSION", CID, Orch::Cni, &conf);
            s.plugin = plugin.into();
            s.prev_result = false;
            s.raw_stdin = Some(stdin.unwrap_or_default().into());
            let mut seed = Seed::default();
            seed.pods.clear();
            all.push(case(
                format!("etcd/version/{plugin}/{name}"),
                Store::Etcd,
                seed,
                vec![s],
            ));
        }
    }
}

/// The MTU file calico/node writes (`/var/lib/calico/mtu`), with and without `mtu` set.
fn mtu_files(all: &mut Vec<Case>) {
    for store in STORES {
        for (name, file, extra) in [
            ("file-only", Some("1440"), json!({})),
            ("file-and-conf", Some("1440"), json!({"mtu": 1400})),
            ("file-and-negative", Some("1440"), json!({"mtu": -1})),
            ("file-not-a-number", Some("abc"), json!({})),
            ("file-with-newline", Some("1450\n"), json!({})),
            (
                "required-and-missing",
                None,
                json!({"require_mtu_file": true}),
            ),
            (
                "required-and-present",
                Some("1460"),
                json!({"require_mtu_file": true}),
            ),
        ] {
            let mut seed = seed_for(Family::V4, Orch::K8s);
            seed.mtu_file = file.map(str::to_string);
            let conf = with(base_conf(store, "1.0.0", Orch::K8s), extra);
            let mut del = step("DEL", CID, Orch::K8s, &conf);
            del.prev_result = false;
            all.push(case(
                format!("{}/mtu/{name}", store.name()),
                store,
                seed,
                vec![step("ADD", CID, Orch::K8s, &conf), del],
            ));
        }
        // cniVersions listed, no cniVersion.
        let conf = with(
            base_conf(store, "1.0.0", Orch::K8s),
            json!({"cniVersion": null, "cniVersions": ["0.4.0", "1.0.0"]}),
        );
        all.push(case(
            format!("{}/netconf/cniVersions-list", store.name()),
            store,
            seed_for(Family::V4, Orch::K8s),
            vec![
                step("ADD", CID, Orch::K8s, &conf),
                step("DEL", CID, Orch::K8s, &conf),
            ],
        ));
    }
}

/// Routes the pod gets (host-local's, the default ones), `usePodCidr`, forwarding.
fn routes_and_settings(all: &mut Vec<Case>) {
    for store in STORES {
        for (name, extra) in [
            (
                "host-local-routes",
                json!({"ipam": {"type": "host-local", "subnet": "10.66.0.0/24", "routes": [{"dst": "10.123.0.0/16"}, {"dst": "192.0.2.0/24", "gw": "10.66.0.1"}]}}),
            ),
            (
                "host-local-default-routes",
                json!({"include_default_routes": true, "ipam": {"type": "host-local", "subnet": "10.66.0.0/24", "routes": [{"dst": "10.123.0.0/16"}]}}),
            ),
            (
                "use-pod-cidr",
                json!({"ipam": {"type": "host-local", "subnet": "usePodCidr"}}),
            ),
            (
                "use-pod-cidr-v6",
                json!({"ipam": {"type": "host-local", "subnet": "usePodCidrIPv6"}}),
            ),
            (
                "use-pod-cidr-dual",
                json!({"ipam": {"type": "host-local", "ranges": [[{"subnet": "usePodCidr"}], [{"subnet": "usePodCidrIPv6"}]]}}),
            ),
            (
                "allow-ip-forwarding",
                json!({"container_settings": {"allow_ip_forwarding": true}}),
            ),
            ("num-queues-4", json!({"num_queues": 4})),
            (
                "calico-ipam-routes-ignored",
                json!({"ipam": {"routes": [{"dst": "10.123.0.0/16"}]}}),
            ),
        ] {
            let conf = with(base_conf(store, "1.0.0", Orch::K8s), extra);
            all.push(case(
                format!("{}/settings/{name}", store.name()),
                store,
                seed_for(Family::Dual, Orch::K8s),
                vec![
                    step("ADD", CID, Orch::K8s, &conf),
                    step("CHECK", CID, Orch::K8s, &conf),
                    step("DEL", CID, Orch::K8s, &conf),
                ],
            ));
        }
        // Dual stack through the orders runtimes make.
        let conf = with(
            base_conf(store, "0.3.1", Orch::K8s),
            json!({"ipam": ipam_for("calico-ipam", Family::Dual)}),
        );
        let add = step("ADD", CID, Orch::K8s, &conf);
        let del = step("DEL", CID, Orch::K8s, &conf);
        let mut add_new = step("ADD", CID2, Orch::K8s, &conf);
        add_new.netns = NetnsArg::Pod(1);
        let mut del_new = step("DEL", CID2, Orch::K8s, &conf);
        del_new.netns = NetnsArg::Pod(1);
        let id = |w: &str| format!("{}/sequence/{w}/dual", store.name());
        let seed = || seed_for(Family::Dual, Orch::K8s);
        all.push(case(
            id("re-add"),
            store,
            seed(),
            vec![add.clone(), add.clone(), del.clone()],
        ));
        all.push(case(
            id("stale-sandbox-del"),
            store,
            seed(),
            vec![add.clone(), add_new.clone(), del.clone(), del_new.clone()],
        ));
        let mut no_netns = del.clone();
        no_netns.netns = NetnsArg::Literal(String::new());
        all.push(case(
            id("del-without-netns"),
            store,
            seed(),
            vec![add.clone(), no_netns, del.clone()],
        ));
        // A pod in another namespace, with labels (its profile is the namespace's).
        let mut seed = seed_for(Family::V4, Orch::K8s);
        seed.namespaces.push(super::case::NamespaceSeed {
            name: "ns2".into(),
            labels: json!({"team": "red"}),
            annotations: Value::Null,
        });
        seed.pods = vec![PodSeed {
            namespace: "ns2".into(),
            ..pod(json!({"app": "db"}), Value::Null)
        }];
        let conf = base_conf(store, "1.0.0", Orch::K8s);
        let mut add = step("ADD", CID, Orch::K8s, &conf);
        add.cni_args = add
            .cni_args
            .replace("K8S_POD_NAMESPACE=default", "K8S_POD_NAMESPACE=ns2");
        let mut del = add.clone();
        del.command = "DEL".into();
        all.push(case(
            format!("{}/annotations/other-namespace", store.name()),
            store,
            seed,
            vec![add, del],
        ));
        // calico-ipam alone with IP=.
        for (name, ip) in [
            ("v4", "10.65.2.3"),
            ("v6", "fd80:24e2:f998:72d6::3"),
            ("outside", "10.98.0.1"),
        ] {
            let conf = with(
                base_conf(store, "0.3.1", Orch::Cni),
                json!({"ipam": ipam_for("calico-ipam", Family::Dual)}),
            );
            let mut add = ipam_step("ADD", CID, Orch::Cni, &conf);
            add.cni_args = format!("IP={ip}");
            let mut del = add.clone();
            del.command = "DEL".into();
            all.push(case(
                format!("{}/ipam-alone/ip-arg-{name}", store.name()),
                store,
                seed_for(Family::Dual, Orch::Cni),
                vec![add, del],
            ));
        }
        // A namespace that does not exist: read only to choose pools, so an `IP=` call
        // never reads it, and an AutoAssign call fails on it.
        for (name, ip) in [("ip-arg", Some("10.65.2.3")), ("auto", None)] {
            let conf = base_conf(store, "1.0.0", Orch::K8s);
            let mut add = ipam_step("ADD", CID, Orch::K8s, &conf);
            // As kubelet sends them: calico-ipam refuses the K8S_* args without it.
            add.cni_args = format!(
                "IgnoreUnknown=1;{}",
                add.cni_args
                    .replace("K8S_POD_NAMESPACE=default", "K8S_POD_NAMESPACE=nowhere")
            );
            if let Some(ip) = ip {
                add.cni_args = format!("{};IP={ip}", add.cni_args);
            }
            let mut del = add.clone();
            del.command = "DEL".into();
            all.push(case(
                format!("{}/ipam-alone/{name}-unknown-namespace", store.name()),
                store,
                seed_for(Family::V4, Orch::K8s),
                vec![add, del],
            ));
        }
    }
}

/// The gRPC dataplane (`dataplane_options.type: grpc`), one test agent answering both.
fn grpc_dataplane(all: &mut Vec<Case>) {
    for store in STORES {
        for orch in [Orch::K8s, Orch::Cni] {
            if store == Store::Kdd && orch == Orch::Cni {
                continue;
            }
            for (name, socket) in [
                ("unix-url", "unix:///var/run/calico/grpc.sock"),
                ("unix-path", "unix:/var/run/calico/grpc.sock"),
                ("no-agent", "unix:///var/run/calico/nothing.sock"),
                ("tcp", "127.0.0.1:1"),
            ] {
                let mut seed = seed_for(Family::V4, orch);
                seed.grpc_agent = true;
                let conf = with(
                    base_conf(store, "1.0.0", orch),
                    json!({"dataplane_options": {"type": "grpc", "socket": socket}}),
                );
                let orch_name = if orch == Orch::K8s { "k8s" } else { "cni" };
                all.push(case(
                    format!("{}/grpc/{name}/{orch_name}", store.name()),
                    store,
                    seed,
                    vec![
                        step("ADD", CID, orch, &conf),
                        step("DEL", CID, orch, &conf),
                        step("DEL", CID, orch, &conf),
                    ],
                ));
            }
        }
    }
}

/// `calico-ipam -upgrade`, as the upgrade-ipam init container runs it, with and without
/// host-local's data.
fn ipam_upgrade(all: &mut Vec<Case>) {
    let upgrade = || {
        let mut s = ipam_step("ADD", CID, Orch::Cni, &json!({}));
        s.argv = vec!["-upgrade".into()];
        s.env = vec![
            ("KUBERNETES_NODE_NAME".into(), "node1".into()),
            ("KUBECONFIG".into(), "/etc/cni/net.d/node-kubeconfig".into()),
            ("DATASTORE_TYPE".into(), "kubernetes".into()),
        ];
        s
    };
    let files = |ips: &[(&str, &str)]| -> Vec<(String, String)> {
        let mut f: Vec<(String, String)> = ips
            .iter()
            .map(|(ip, cid)| (ip.to_string(), format!("{cid}\r\neth0")))
            .collect();
        f.push((
            "last_reserved_ip.0".into(),
            ips.last().map(|(ip, _)| ip.to_string()).unwrap_or_default(),
        ));
        f
    };
    for (name, data) in [
        ("no-host-local-data", None),
        ("host-local-empty", Some(files(&[]))),
        (
            "host-local-two-pods",
            Some(files(&[
                ("10.244.1.5", "c0ffee00aa01"),
                ("10.244.1.6", "c0ffee00aa02"),
            ])),
        ),
    ] {
        let mut seed = Seed::default();
        seed.pools
            .push(Pool::new("podcidr-pool", "10.244.0.0/16", 26));
        if let Some(data) = data {
            seed.host_local_files = data;
        }
        // After the upgrade, a pod's ADD on calico-ipam.
        seed.pods.push(pod(json!({"app": "web"}), Value::Null));
        let conf = base_conf(Store::Kdd, "0.3.1", Orch::K8s);
        all.push(case(
            format!("kdd/upgrade/{name}"),
            Store::Kdd,
            seed,
            vec![
                upgrade(),
                step("ADD", CID, Orch::K8s, &conf),
                step("DEL", CID, Orch::K8s, &conf),
            ],
        ));
    }
    // A Node calico/node never set up (no BGP address yet).
    let mut seed = Seed {
        node_bgp: false,
        host_local_files: files(&[("10.244.1.9", "c0ffee00aa09")]),
        ..Default::default()
    };
    seed.pools
        .push(Pool::new("podcidr-pool", "10.244.0.0/16", 26));
    all.push(case(
        "kdd/upgrade/node-without-bgp".into(),
        Store::Kdd,
        seed,
        vec![upgrade()],
    ));
    // Not yet upgraded: ClusterInformation not ready until it is.
    let mut seed = Seed {
        cluster_ready: Some(false),
        host_local_files: files(&[("10.244.1.9", "c0ffee00aa09")]),
        ..Default::default()
    };
    seed.pools
        .push(Pool::new("podcidr-pool", "10.244.0.0/16", 26));
    all.push(case(
        "kdd/upgrade/not-ready".into(),
        Store::Kdd,
        seed,
        vec![upgrade()],
    ));
}

/// KubeVirt virt-launcher pods: a VM's address kept across its pods.
fn kubevirt(all: &mut Vec<Case>) {
    let kv = "/apis/kubevirt.io/v1/namespaces/default";
    let vm = json!({"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine",
        "metadata":{"name":"vm1","namespace":"default"},"spec":{"running":true}});
    let vmi = |owned: bool| {
        let mut v = json!({"apiVersion":"kubevirt.io/v1","kind":"VirtualMachineInstance",
            "metadata":{"name":"vm1","namespace":"default"},"spec":{}});
        if owned {
            v["metadata"]["ownerReferences"] = json!([{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine",
                "name":"vm1","uid":format!("{{uid:{kv}/virtualmachines/vm1}}"),"controller":true,"blockOwnerDeletion":true}]);
        }
        v
    };
    let launcher = |name: &str, migration: Option<&str>| {
        let mut labels = json!({"kubevirt.io/domain": "vm1", "app": name});
        if let Some(m) = migration {
            labels["kubevirt.io/migrationJobUID"] = json!(m);
        }
        PodSeed {
            namespace: NS.into(),
            name: name.into(),
            labels,
            annotations: Value::Null,
            extra: json!({"metadata":{"ownerReferences":[{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachineInstance",
                "name":"vm1","uid":format!("{{uid:{kv}/virtualmachineinstances/vm1}}"),"controller":true,"blockOwnerDeletion":true}]}}),
        }
    };
    let pod_step = |command: &str, cid: &str, pod: &str, netns: usize, conf: &Value| {
        let mut s = step(command, cid, Orch::K8s, conf);
        s.cni_args =
            format!("K8S_POD_NAMESPACE={NS};K8S_POD_NAME={pod};K8S_POD_INFRA_CONTAINER_ID={cid}");
        s.netns = NetnsArg::Pod(netns);
        s.prev_result = false;
        s
    };
    for store in [Store::Kdd, Store::Etcd] {
        for (name, owned_by_vm, persistence) in [
            ("vm", true, None),
            ("vmi-alone", false, None),
            ("persistence-disabled", true, Some("Disabled")),
        ] {
            let mut seed = seed_for(Family::V4, Orch::K8s);
            seed.pods = vec![
                launcher("virt-launcher-vm1-aaaaa", None),
                launcher("virt-launcher-vm1-bbbbb", None),
            ];
            if owned_by_vm {
                seed.api_objects
                    .push((format!("{kv}/virtualmachines/vm1"), vm.clone()));
            }
            seed.api_objects.push((
                format!("{kv}/virtualmachineinstances/vm1"),
                vmi(owned_by_vm),
            ));
            if let Some(p) = persistence {
                seed.ipam_config = Some(match store {
                    Store::Kdd => {
                        json!({"autoAllocateBlocks": true, "strictAffinity": false, "kubeVirtVMAddressPersistence": p})
                    }
                    Store::Etcd => {
                        json!({"auto_allocate_blocks": true, "strict_affinity": false, "kubeVirtVMAddressPersistence": p})
                    }
                });
            }
            let conf = base_conf(store, "1.0.0", Orch::K8s);
            let a = "virt-launcher-vm1-aaaaa";
            let b = "virt-launcher-vm1-bbbbb";
            // The VM's pod, DELeted, then the VM's next pod (a restart).
            all.push(case(
                format!("{}/kubevirt/{name}/restart", store.name()),
                store,
                seed.clone(),
                vec![
                    pod_step("ADD", CID, a, 0, &conf),
                    pod_step("DEL", CID, a, 0, &conf),
                    pod_step("ADD", CID2, b, 1, &conf),
                    pod_step("DEL", CID2, b, 1, &conf),
                ],
            ));
            // Two pods of the VM at once (a migration's source and target).
            let mut mig = seed.clone();
            mig.pods[1] = launcher(b, Some("mig-1"));
            all.push(case(
                format!("{}/kubevirt/{name}/migration", store.name()),
                store,
                mig,
                vec![
                    pod_step("ADD", CID, a, 0, &conf),
                    pod_step("ADD", CID2, b, 1, &conf),
                    pod_step("DEL", CID, a, 0, &conf),
                    pod_step("DEL", CID2, b, 1, &conf),
                ],
            ));
        }
    }
}

/// One binary ADDs, the other DELs or re-ADDs: the plugin-level swap and rollback. Each
/// runs against the same sequence made by upstream alone.
fn mixed(all: &mut Vec<Case>) {
    for store in STORES {
        for family in [Family::V4, Family::Dual] {
            for (a, b, dir) in [
                (By::Upstream, By::Ours, "swap"),
                (By::Ours, By::Upstream, "rollback"),
            ] {
                let conf = with(
                    base_conf(store, "0.3.1", Orch::K8s),
                    json!({"ipam": ipam_for("calico-ipam", family)}),
                );
                let by = |mut s: Step, who: By| {
                    s.by = who;
                    s
                };
                let add = step("ADD", CID, Orch::K8s, &conf);
                let del = step("DEL", CID, Orch::K8s, &conf);
                let f = family.name();
                let s = store.name();
                all.push(case(
                    format!("{s}/mixed/{dir}/{f}/add-del"),
                    store,
                    seed_for(family, Orch::K8s),
                    vec![by(add.clone(), a), by(del.clone(), b), by(del.clone(), a)],
                ));
                all.push(case(
                    format!("{s}/mixed/{dir}/{f}/re-add"),
                    store,
                    seed_for(family, Orch::K8s),
                    vec![by(add.clone(), a), by(add.clone(), b), by(del.clone(), b)],
                ));
                let mut add2 = step("ADD", CID2, Orch::K8s, &conf);
                add2.netns = NetnsArg::Pod(1);
                let mut del2 = step("DEL", CID2, Orch::K8s, &conf);
                del2.netns = NetnsArg::Pod(1);
                all.push(case(
                    format!("{s}/mixed/{dir}/{f}/new-sandbox"),
                    store,
                    seed_for(family, Orch::K8s),
                    vec![
                        by(add.clone(), a),
                        by(add2.clone(), b),
                        by(del.clone(), b),
                        by(del2.clone(), a),
                    ],
                ));
                let cni = with(
                    base_conf(store, "0.3.1", Orch::Cni),
                    json!({"ipam": ipam_for("calico-ipam", family)}),
                );
                all.push(case(
                    format!("{s}/mixed/{dir}/{f}/cni-add-del"),
                    store,
                    seed_for(family, Orch::Cni),
                    vec![
                        by(step("ADD", CID, Orch::Cni, &cni), a),
                        by(step("DEL", CID, Orch::Cni, &cni), b),
                    ],
                ));
                let mut ipam_add = ipam_step("ADD", CID, Orch::Cni, &cni);
                ipam_add.by = a;
                let mut ipam_del = ipam_step("DEL", CID, Orch::Cni, &cni);
                ipam_del.by = b;
                all.push(case(
                    format!("{s}/mixed/{dir}/{f}/ipam-add-del"),
                    store,
                    seed_for(family, Orch::Cni),
                    vec![ipam_add, ipam_del],
                ));
            }
        }
    }
}

#[test]
fn the_corpus_is_large_and_half_real_api_server() {
    let all = corpus();
    let kdd = all.iter().filter(|c| c.store == Store::Kdd).count();
    let mut ids: Vec<&str> = all.iter().map(|c| c.id.as_str()).collect();
    ids.sort();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "case ids are unique");
    assert!(all.len() >= 600, "{} cases", all.len());
    assert!(
        kdd * 10 >= all.len() * 4,
        "{kdd} of {} on the Kubernetes datastore",
        all.len()
    );
}

#[test]
#[ignore = "prints the corpus's size"]
fn count() {
    let all = corpus();
    let kdd = all.iter().filter(|c| c.store == Store::Kdd).count();
    let mixed = all.iter().filter(|c| !c.single_binary()).count();
    eprintln!(
        "{} cases, {kdd} on the Kubernetes datastore, {mixed} mixed",
        all.len()
    );
}
