//! KubeVirt VM address persistence end to end, on the real kube-apiserver (common/real_k8s.rs)
//! with the kubevirt.io resources the plugin reads registered as CRDs by the test (KubeVirt's
//! own controllers do not run: the test plays them, creating VMs, VMIs and their launcher
//! pods, and deleting them behind a finalizer so that their deletion is seen in progress, as
//! KubeVirt's finalizers make it).
//!
//! A VM keeps its address across restarts (a new VMI and launcher pod each time), a live
//! migration's target gets it (without host routes) and persistence off refuses the
//! target, deleting the VM frees it, CNI GC never collects it, and concurrent ADDs for one
//! VM never give it two addresses.

use std::collections::BTreeSet;

use crate::common;
use crate::common::cluster::Cluster;
use crate::common::cni::{with_prev_result, Invocation};
use crate::common::kdd::{RealKddWorld, CRD};
use crate::common::netns::{require_root, Netns};
use serde_json::{json, Value};

const NS: &str = "vms";
const KV: &str = "/apis/kubevirt.io/v1";
/// Keeps a deleted object around, its deletion in progress (KubeVirt's own finalizers do so
/// until the VM's pods are gone).
const HOLD: &str = "test.projectcalico.org/hold";

macro_rules! real_world {
    ($test:literal) => {{
        require_root();
        match RealKddWorld::real_or_skip($test) {
            Some(w) => {
                install_kubevirt(&w);
                w
            }
            None => return,
        }
    }};
}

/// The VirtualMachine and VirtualMachineInstance CRDs (kubevirt.io/v1, namespaced, any
/// content), served before returning; the test namespace.
fn install_kubevirt(w: &RealKddWorld) {
    for (kind, plural, short) in [
        ("VirtualMachine", "virtualmachines", "vm"),
        ("VirtualMachineInstance", "virtualmachineinstances", "vmi"),
    ] {
        let crd = json!({"apiVersion":"apiextensions.k8s.io/v1","kind":"CustomResourceDefinition",
            "metadata":{"name": format!("{plural}.kubevirt.io")},
            "spec":{"group":"kubevirt.io","scope":"Namespaced",
                "names":{"kind":kind,"plural":plural,"singular":kind.to_lowercase(),"shortNames":[short]},
                "versions":[{"name":"v1","served":true,"storage":true,
                    "schema":{"openAPIV3Schema":{"type":"object","x-kubernetes-preserve-unknown-fields":true}}}]}});
        let a = w.api.post(
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            crd,
        );
        assert!(a.status == 201 || a.status == 409, "{a:?}");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let served = w.api.get(KV).is_some_and(|d| {
            let names: Vec<&str> = d["resources"]
                .as_array()
                .map(|r| r.iter().filter_map(|r| r["name"].as_str()).collect())
                .unwrap_or_default();
            names.contains(&"virtualmachines") && names.contains(&"virtualmachineinstances")
        });
        if served {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "KubeVirt CRDs not served"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    w.seed_namespace(NS, json!({}), json!({}));
}

/// Creates VM `name` (held by the finalizer); returns its UID.
fn create_vm(w: &RealKddWorld, name: &str) -> String {
    let vm = w.api.put(
        &format!("{KV}/namespaces/{NS}/virtualmachines/{name}"),
        json!({"apiVersion":"kubevirt.io/v1","kind":"VirtualMachine",
            "metadata":{"name":name,"namespace":NS,"finalizers":[HOLD]},"spec":{"running":true}}),
    );
    vm["metadata"]["uid"].as_str().unwrap().to_string()
}

/// Creates VMI `name`, owned by VM `name` (uid `vm_uid`) when given; returns its UID.
fn create_vmi(w: &RealKddWorld, name: &str, vm_uid: Option<&str>) -> String {
    let mut vmi = json!({"apiVersion":"kubevirt.io/v1","kind":"VirtualMachineInstance",
        "metadata":{"name":name,"namespace":NS,"finalizers":[HOLD]},"spec":{}});
    if let Some(uid) = vm_uid {
        vmi["metadata"]["ownerReferences"] = json!([{"apiVersion":"kubevirt.io/v1",
            "kind":"VirtualMachine","name":name,"uid":uid,"controller":true,"blockOwnerDeletion":true}]);
    }
    let path = format!("{KV}/namespaces/{NS}/virtualmachineinstances/{name}");
    let stored = w.api.put(&path, vmi);
    stored["metadata"]["uid"].as_str().unwrap().to_string()
}

/// Deletes a KubeVirt object: held by the finalizer, its deletion stays in progress.
fn start_deleting(w: &RealKddWorld, plural: &str, name: &str) {
    w.api
        .remove(&format!("{KV}/namespaces/{NS}/{plural}/{name}"));
}

/// Lets a KubeVirt object held by the finalizer go.
fn finish_deleting(w: &RealKddWorld, plural: &str, name: &str) {
    let path = format!("{KV}/namespaces/{NS}/{plural}/{name}");
    if w.api.get(&path).is_some() {
        w.api.patch(&path, json!({"metadata":{"finalizers":null}}));
        w.api.remove(&path);
    }
}

/// A launcher pod of VMI `vmi` (uid `vmi_uid`); a migration target when `migration` names
/// the migration's UID.
fn launcher_pod(w: &RealKddWorld, pod: &str, vmi: &str, vmi_uid: &str, migration: Option<&str>) {
    let mut labels = json!({"kubevirt.io/domain": vmi, "app": pod});
    if let Some(m) = migration {
        labels["kubevirt.io/migrationJobUID"] = json!(m);
    }
    w.seed_pod(
        NS,
        pod,
        json!({"metadata":{"labels": labels,
            "ownerReferences":[{"apiVersion":"kubevirt.io/v1","kind":"VirtualMachineInstance",
                "name":vmi,"uid":vmi_uid,"controller":true,"blockOwnerDeletion":true}]}}),
    );
}

fn ipam_inv(cmd: &str, cid: &str, pod: &str) -> Invocation {
    Invocation::new(cmd, cid, "/dev/null")
        .k8s(NS, pod)
        .via_calico()
}

fn address(result: &Value) -> String {
    let a = result["ips"][0]["address"].as_str().expect("an address");
    a.split('/').next().unwrap().to_string()
}

fn vm_handle(w: &RealKddWorld, vm: &str) -> String {
    format!("{}.vmi.{NS}.{vm}", w.network())
}

/// The allocation attribute of `ip` (`handle_id`, `secondary`, `alternateOwnerAttrs`).
fn attribute_of(w: &RealKddWorld, ip: &str) -> Value {
    for b in w.blocks() {
        for a in common::cluster::block_allocations(&b) {
            if a.ip.to_string() == ip {
                let cidr = b["cidr"].as_str().unwrap();
                let base: std::net::IpAddr = cidr.split('/').next().unwrap().parse().unwrap();
                let (std::net::IpAddr::V4(base), std::net::IpAddr::V4(ipv4)) =
                    (base, ip.parse::<std::net::IpAddr>().unwrap())
                else {
                    panic!("IPv4 only here")
                };
                let ordinal = (u32::from(ipv4) - u32::from(base)) as usize;
                let idx = b["allocations"][ordinal].as_u64().unwrap() as usize;
                return b["attributes"][idx].clone();
            }
        }
    }
    panic!("{ip} is not allocated")
}

/// GC as a runtime runs it, knowing only the containers in `valid`: the VM's address stays.
fn gc_keeps(w: &RealKddWorld, valid: &[&str], vm_handle: &str) {
    let mut conf: Value = serde_json::from_str(&w.conf(json!({"cniVersion":"1.1.0"}))).unwrap();
    conf["cni.dev/valid-attachments"] = json!(valid
        .iter()
        .map(|c| json!({"containerID": c, "ifname": "eth0"}))
        .collect::<Vec<_>>());
    let gc = Invocation {
        command: "GC".into(),
        unset: ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_ARGS"]
            .map(String::from)
            .to_vec(),
        ..Default::default()
    };
    w.calico(&gc, &conf.to_string()).assert_ok();
    assert!(
        w.handles().contains(&vm_handle.to_string()),
        "GC collected {vm_handle}: {:?}",
        w.handles()
    );
}

/// A VM restarted three times (each restart a new VMI and launcher pod, through `calico`
/// with the pod's network namespace) keeps its one address; the old pod's DEL, before or
/// after its VMI is gone, keeps it; GC never collects it; deleting the VM frees it.
#[test]
fn a_vm_keeps_its_address_across_restarts_until_it_is_deleted() {
    let w = real_world!("a_vm_keeps_its_address_across_restarts_until_it_is_deleted");
    let vm_uid = create_vm(&w, "vm1");
    let handle = vm_handle(&w, "vm1");
    let conf = w.conf(json!({}));
    let mut first: Option<String> = None;
    let mut pods: Vec<(Netns, Invocation)> = Vec::new();
    for restart in 0..4 {
        let vmi_uid = create_vmi(&w, "vm1", Some(&vm_uid));
        let pod_name = format!("virt-launcher-vm1-r{restart}");
        launcher_pod(&w, &pod_name, "vm1", &vmi_uid, None);
        let netns = Netns::new("vmpod");
        let cid = format!("vm1r{restart}");
        let inv = Invocation::new("ADD", &cid, netns.path()).k8s(NS, &pod_name);
        let mark = w.api.audit_mark();
        let r = w.calico(&inv, &conf).assert_ok().json();
        let reqs = w.api.plugin_requests_since(mark);
        // The pod is read once, by the plugin, and not again by its in-process IPAM.
        let pod_reads = reqs
            .iter()
            .filter(|q| {
                q.verb == "get" && q.path() == format!("/api/v1/namespaces/{NS}/pods/{pod_name}")
            })
            .count();
        assert_eq!(
            pod_reads,
            1,
            "{}",
            reqs.iter().map(|q| q.line()).collect::<Vec<_>>().join("\n")
        );
        let ip = address(&r);
        match &first {
            None => first = Some(ip.clone()),
            Some(f) => assert_eq!(&ip, f, "restart {restart} got another address"),
        }
        // A source pod's result has its routes, and the host routes to the pod.
        assert!(!r["routes"].as_array().unwrap().is_empty(), "{r}");
        assert!(w.host_sh("ip route show").contains(&ip));
        let attr = attribute_of(&w, &ip);
        assert_eq!(attr["handle_id"], handle.as_str());
        assert_eq!(attr["secondary"]["pod"], pod_name.as_str(), "{attr}");
        assert_eq!(attr["secondary"]["vmi-name"], "vm1");
        assert_eq!(attr["secondary"]["vmi-uid"], vmi_uid.as_str());
        assert_eq!(attr["secondary"]["vm-uid"], vm_uid.as_str());
        assert_eq!(w.handles(), vec![handle.clone()]);
        gc_keeps(&w, &[&cid], &handle);

        // The restart: the VM stays; its VMI goes (on odd restarts before the old pod's
        // DEL, so that DEL finds it gone), the pod's DEL keeps the address, ownerless.
        if restart % 2 == 1 {
            start_deleting(&w, "virtualmachineinstances", "vm1");
            finish_deleting(&w, "virtualmachineinstances", "vm1");
        }
        w.calico(&inv.as_del(), &conf).assert_ok();
        let attr = attribute_of(&w, &ip);
        assert!(attr.get("secondary").is_none(), "{attr}");
        gc_keeps(&w, &[], &handle);
        if restart % 2 == 0 {
            start_deleting(&w, "virtualmachineinstances", "vm1");
            finish_deleting(&w, "virtualmachineinstances", "vm1");
        }
        pods.push((netns, inv));
    }
    // DEL again (a runtime's retry): nothing changes.
    let (_, last) = pods.last().unwrap();
    w.calico(&last.as_del(), &conf).assert_ok();
    assert_eq!(w.handles(), vec![handle.clone()]);

    // The VM is deleted: its last pod's DEL frees the address.
    let vmi_uid = create_vmi(&w, "vm1", Some(&vm_uid));
    launcher_pod(&w, "virt-launcher-vm1-last", "vm1", &vmi_uid, None);
    let netns = Netns::new("vmpod");
    let inv = Invocation::new("ADD", "vm1last", netns.path()).k8s(NS, "virt-launcher-vm1-last");
    let r = w.calico(&inv, &conf).assert_ok().json();
    assert_eq!(Some(address(&r)), first);
    start_deleting(&w, "virtualmachines", "vm1");
    w.calico(&inv.as_del(), &conf).assert_ok();
    assert!(w.handles().is_empty(), "{:?}", w.handles());
    assert!(w.allocated().is_empty());
    finish_deleting(&w, "virtualmachineinstances", "vm1");
    finish_deleting(&w, "virtualmachines", "vm1");
    w.assert_clean();
}

/// A live migration's target gets the VM's address as its alternate owner, without host
/// routes; the source's DEL leaves the target owning it; the target's DEL (the VM not
/// going away) keeps it. With persistence off, a target is refused and a source pod is an
/// ordinary pod (its container's handle).
#[test]
fn a_migration_target_gets_the_vms_address_and_persistence_off_refuses_it() {
    let w = real_world!("a_migration_target_gets_the_vms_address_and_persistence_off_refuses_it");
    let vm_uid = create_vm(&w, "vm2");
    let vmi_uid = create_vmi(&w, "vm2", Some(&vm_uid));
    let handle = vm_handle(&w, "vm2");
    let conf = w.conf(json!({}));
    launcher_pod(&w, "virt-launcher-vm2-src", "vm2", &vmi_uid, None);
    launcher_pod(&w, "virt-launcher-vm2-dst", "vm2", &vmi_uid, Some("mig-1"));

    // A target before the VM has an address: refused, nothing allocated.
    let dst = ipam_inv("ADD", "vm2dst", "virt-launcher-vm2-dst");
    let err = w.ipam(&dst, &conf).assert_err();
    assert_eq!(
        err["msg"],
        format!("migration target pod but no IP allocated to VM handle {handle}")
    );
    assert!(w.allocated().is_empty());

    let src_ns = Netns::new("vmsrc");
    let src = Invocation::new("ADD", "vm2src", src_ns.path()).k8s(NS, "virt-launcher-vm2-src");
    let src_result = w.calico(&src, &conf).assert_ok().json();
    let ip = address(&src_result);
    let src_veth = src_result["interfaces"][0]["name"]
        .as_str()
        .unwrap()
        .to_string();

    // The target, through `calico`: the same address, no routes in the result, no host
    // route to its interface (the source's host route stays until the migration ends).
    let dst_ns = Netns::new("vmdst");
    let dst = Invocation::new("ADD", "vm2dst", dst_ns.path()).k8s(NS, "virt-launcher-vm2-dst");
    let r = w.calico(&dst, &conf).assert_ok().json();
    assert_eq!(address(&r), ip);
    assert!(r.get("routes").is_none(), "{r}");
    let host_routes = w.host_sh(&format!("ip route show {ip}"));
    assert_eq!(host_routes.lines().count(), 1, "{host_routes}");
    assert!(host_routes.contains(&src_veth), "{host_routes}");
    let attr = attribute_of(&w, &ip);
    assert_eq!(attr["secondary"]["pod"], "virt-launcher-vm2-src", "{attr}");
    assert_eq!(
        attr["alternateOwnerAttrs"]["pod"], "virt-launcher-vm2-dst",
        "{attr}"
    );
    assert_eq!(attr["alternateOwnerAttrs"]["vmim-uid"], "mig-1", "{attr}");
    // CHECK of the target: its addresses are the VM handle's; it has no host route.
    w.calico(&dst.as_check(), &with_prev_result(&conf, &r))
        .assert_ok();
    gc_keeps(&w, &["vm2src", "vm2dst"], &handle);

    // The source goes: the target owns the address; then the target's DEL keeps it.
    w.calico(&src.as_del(), &conf).assert_ok();
    let attr = attribute_of(&w, &ip);
    assert!(attr.get("secondary").is_none(), "{attr}");
    assert_eq!(attr["alternateOwnerAttrs"]["pod"], "virt-launcher-vm2-dst");
    w.calico(&dst.as_del(), &conf).assert_ok();
    assert_eq!(w.handles(), vec![handle.clone()]);
    gc_keeps(&w, &[], &handle);

    // Persistence off.
    w.api.put(
        &format!("{CRD}/ipamconfigs/default"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPAMConfig",
            "metadata":{"name":"default"},
            "spec":{"strictAffinity":false,"autoAllocateBlocks":true,
                "kubeVirtVMAddressPersistence":"Disabled"}}),
    );
    let err = w
        .ipam(&ipam_inv("ADD", "vm2dst2", "virt-launcher-vm2-dst"), &conf)
        .assert_err();
    assert_eq!(
        err["msg"],
        "live migration target pod is not allowed when KubeVirtVMAddressPersistence is disabled"
    );
    let plain = ipam_inv("ADD", "vm2plain", "virt-launcher-vm2-src");
    let other = address(&w.ipam(&plain, &conf).assert_ok().json());
    assert_ne!(other, ip);
    assert_eq!(
        attribute_of(&w, &other)["handle_id"],
        format!("{}.vm2plain", w.network())
    );
    w.ipam(&plain.as_del(), &conf).assert_ok();
    assert_eq!(w.handles(), vec![handle.clone()]);
}

/// Two launcher pods of one new VM added at once (as a restarting VM's old and new pod may
/// be) get one address between them: the handle's compare-and-swap lets one allocate and
/// hands the other the same address. Five VMs, so that the race is really run.
#[test]
fn concurrent_adds_for_one_vm_never_get_two_addresses() {
    let w = real_world!("concurrent_adds_for_one_vm_never_get_two_addresses");
    let conf = w.conf(json!({}));
    for n in 0..5 {
        let vm = format!("vmc{n}");
        let vm_uid = create_vm(&w, &vm);
        let vmi_uid = create_vmi(&w, &vm, Some(&vm_uid));
        for p in ["a", "b"] {
            launcher_pod(&w, &format!("virt-launcher-{vm}-{p}"), &vm, &vmi_uid, None);
        }
        let results: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = ["a", "b"]
                .map(|p| {
                    let inv = ipam_inv(
                        "ADD",
                        &format!("{vm}{p}"),
                        &format!("virt-launcher-{vm}-{p}"),
                    );
                    let (w, conf) = (&w, &conf);
                    s.spawn(move || address(&w.ipam(&inv, conf).assert_ok().json()))
                })
                .into_iter()
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(results[0], results[1], "{vm}: two addresses {results:?}");
        let held: BTreeSet<String> = w
            .allocated()
            .into_iter()
            .filter(|a| a.handle == vm_handle(&w, &vm))
            .map(|a| a.ip.to_string())
            .collect();
        assert_eq!(held.len(), 1, "{vm}: {held:?}");
    }
}

/// A VM's pod whose `calico` ADD fails after its IPAM (its netns already has an `eth0`,
/// which is never replaced) gives the VM's address back as its DEL would: it stops owning
/// it, and the VM keeps it (upstream runs IPAM DEL there). Nothing of the pod is left.
#[test]
fn a_failed_add_of_a_vms_pod_only_gives_up_its_ownership() {
    let w = real_world!("a_failed_add_of_a_vms_pod_only_gives_up_its_ownership");
    let vm_uid = create_vm(&w, "vm3");
    let vmi_uid = create_vmi(&w, "vm3", Some(&vm_uid));
    let handle = vm_handle(&w, "vm3");
    let conf = w.conf(json!({}));
    launcher_pod(&w, "virt-launcher-vm3-a", "vm3", &vmi_uid, None);
    let a = ipam_inv("ADD", "vm3a", "virt-launcher-vm3-a");
    let ip = address(&w.ipam(&a, &conf).assert_ok().json());
    w.ipam(&a.as_del(), &conf).assert_ok();

    launcher_pod(&w, "virt-launcher-vm3-b", "vm3", &vmi_uid, None);
    let netns = Netns::new("vmpod");
    netns.ip(&["link", "add", "eth0", "type", "bridge"]);
    let links_before = w.host_sh("ip -o link show | wc -l");
    let b = Invocation::new("ADD", "vm3b", netns.path()).k8s(NS, "virt-launcher-vm3-b");
    let err = w.calico(&b, &conf).assert_err();
    eprintln!("the failed ADD: {err}");
    // The VM keeps its address, owned by no pod; the pod's interface was not made.
    assert_eq!(w.handles(), vec![handle.clone()]);
    let attr = attribute_of(&w, &ip);
    assert_eq!(attr["handle_id"], handle.as_str());
    assert!(attr.get("secondary").is_none(), "{attr}");
    assert_eq!(w.host_sh("ip -o link show | wc -l"), links_before);
    assert!(netns.has_link("eth0"));
    w.calico(&b.as_del(), &conf).assert_ok();
    assert_eq!(w.handles(), vec![handle]);
}
