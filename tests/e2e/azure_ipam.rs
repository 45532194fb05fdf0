//! `ipam.type: azure-vnet-ipam` end to end (upstream's `AddIPAM`/`DeleteIPAM` Azure handling),
//! with a fake `azure-vnet-ipam` in CNI_PATH that records the configuration each verb is
//! sent: ADD asks for the network's stored subnet, the network and endpoint files land as
//! upstream writes them (under the real /var/run/calico/azure/networks, one network name per
//! test, removed afterwards), DEL names the recorded address and subnet and forgets the
//! endpoint, and a DEL with nothing recorded is not sent to the plugin.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::common::cni::Invocation;
use crate::common::netns::{require_root, Netns};
use crate::common::world::World;
use serde_json::{json, Value};

const NETWORKS_DIR: &str = "/var/run/calico/azure/networks";
/// What the fake plugin gives on ADD.
const ADDRESS: &str = "10.240.7.17";
const SUBNET: &str = "10.240.7.0/24";

/// One test's Azure network: its state directory, removed on drop.
struct AzureNet {
    name: String,
}

impl AzureNet {
    fn new(test: &str) -> AzureNet {
        let name = format!("azure-{test}-{}", std::process::id());
        let n = AzureNet { name };
        let _ = std::fs::remove_dir_all(n.dir());
        n
    }

    fn dir(&self) -> PathBuf {
        Path::new(NETWORKS_DIR).join(&self.name)
    }

    fn network_file(&self) -> PathBuf {
        self.dir().join("network.json")
    }

    fn endpoint_file(&self, cid: &str) -> PathBuf {
        self.dir().join(format!("{cid}-eth0"))
    }
}

impl Drop for AzureNet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(self.dir());
    }
}

/// A world whose CNI_PATH has the fake `azure-vnet-ipam`, recording into `rec`.
struct Fixture {
    w: World,
    rec: PathBuf,
    net: AzureNet,
    conf: String,
}

impl Fixture {
    fn new(test: &str) -> Fixture {
        require_root();
        let w = World::new();
        let rec = w.scratch.path().join("azure-calls");
        std::fs::create_dir_all(&rec).expect("record dir");
        let script = format!(
            r#"#!/bin/sh
echo "$CNI_COMMAND" >> '{rec}/calls'
cat > '{rec}/'"$CNI_COMMAND"'.json'
if [ "$CNI_COMMAND" = ADD ]; then
  printf '%s' '{{"cniVersion":"1.0.0","ips":[{{"address":"{ADDRESS}/24","gateway":"10.240.7.1"}}]}}'
fi
"#,
            rec = rec.display()
        );
        let plugin = w.bin.plugin("azure-vnet-ipam");
        std::fs::write(&plugin, script).expect("fake plugin");
        std::fs::set_permissions(&plugin, std::fs::Permissions::from_mode(0o755))
            .expect("chmod fake plugin");
        let net = AzureNet::new(test);
        let conf = w.conf(json!({"name": net.name, "ipam": {"type": "azure-vnet-ipam"}}));
        Fixture { w, rec, net, conf }
    }

    /// The verbs the fake was run for, in order.
    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(self.rec.join("calls"))
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    /// The `ipam` section the fake was last sent for `verb`.
    fn sent_ipam(&self, verb: &str) -> Value {
        let raw = std::fs::read_to_string(self.rec.join(format!("{verb}.json")))
            .unwrap_or_else(|e| panic!("the fake got no {verb}: {e}"));
        let conf: Value = serde_json::from_str(&raw).expect("the fake's stdin is JSON");
        conf["ipam"].clone()
    }

    fn add(&self, cid: &str, pod: &Netns) -> Invocation {
        Invocation::new("ADD", cid, pod.path()).k8s("default", cid)
    }
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A network file upstream left (its subnet) is what ADD asks for; ADD records the network
/// and the endpoint byte for byte as upstream; DEL sends the address and subnet and removes
/// the endpoint file (the network's stays).
#[test]
fn add_asks_for_the_stored_subnet_and_del_names_the_recorded_address() {
    let f = Fixture::new("stored");
    std::fs::create_dir_all(f.net.dir()).expect("network dir");
    // As upstream's Go encoder writes it.
    std::fs::write(
        f.net.network_file(),
        format!(r#"{{"Name":"{}","Subnets":["{SUBNET}"]}}"#, f.net.name),
    )
    .expect("network file");
    let pod = f.w.pod();
    let inv = f.add("azstored1", &pod);
    let result = f.w.calico(&inv, &f.conf).assert_ok().json();
    // The pod gets its address as a /32; the subnet stored is that of the plugin's /24.
    assert_eq!(result["ips"][0]["address"], format!("{ADDRESS}/32"));
    let sent = f.sent_ipam("ADD");
    assert_eq!(sent, json!({"type": "azure-vnet-ipam", "subnet": SUBNET}));

    assert_eq!(
        read(&f.net.network_file()),
        format!(r#"{{"Name":"{}","Subnets":["{SUBNET}"]}}"#, f.net.name)
    );
    let endpoint = f.net.endpoint_file("azstored1");
    assert_eq!(
        read(&endpoint),
        format!(
            r#"{{"Network":"{}","ContainerID":"azstored1","Interface":"eth0","Addresses":["{ADDRESS}"]}}"#,
            f.net.name
        )
    );
    let mode = std::fs::metadata(&endpoint)
        .expect("stat")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "natefinch/atomic's temporary file mode");

    f.w.calico(&inv.as_del(), &f.conf).assert_ok();
    assert_eq!(f.calls(), ["ADD", "DEL"]);
    let sent = f.sent_ipam("DEL");
    assert_eq!(
        sent,
        json!({"type": "azure-vnet-ipam", "ipAddress": ADDRESS, "subnet": SUBNET})
    );
    assert!(
        !endpoint.exists(),
        "the endpoint file is removed after the release"
    );
    assert!(f.net.network_file().exists(), "the network file stays");
    f.w.assert_clean();
}

/// The first ADD on a network (nothing stored) sends the configuration unchanged, then
/// stores the subnet of the address it got, which the next ADD asks for.
#[test]
fn a_first_add_sends_no_subnet_and_stores_the_one_it_got() {
    let f = Fixture::new("first");
    let pod = f.w.pod();
    let inv = f.add("azfirst1", &pod);
    f.w.calico(&inv, &f.conf).assert_ok();
    assert_eq!(f.sent_ipam("ADD"), json!({"type": "azure-vnet-ipam"}));
    assert_eq!(
        read(&f.net.network_file()),
        format!(r#"{{"Name":"{}","Subnets":["{SUBNET}"]}}"#, f.net.name)
    );
    assert!(f.net.endpoint_file("azfirst1").exists());
    f.w.calico(&inv.as_del(), &f.conf).assert_ok();

    let pod2 = f.w.pod();
    let inv2 = f.add("azfirst2", &pod2);
    f.w.calico(&inv2, &f.conf).assert_ok();
    assert_eq!(f.sent_ipam("ADD")["subnet"], SUBNET);
    f.w.calico(&inv2.as_del(), &f.conf).assert_ok();
    assert_eq!(f.calls(), ["ADD", "DEL", "ADD", "DEL"]);
    f.w.assert_clean();
}

/// A DEL with no endpoint recorded for the attachment (never added, or already released)
/// succeeds without running the plugin, as upstream's "skip IPAM release".
#[test]
fn a_del_with_nothing_recorded_does_not_call_the_plugin() {
    let f = Fixture::new("none");
    let pod = f.w.pod();
    let inv = f.add("aznone1", &pod);
    f.w.calico(&inv.as_del(), &f.conf).assert_ok();
    assert_eq!(f.calls(), Vec::<String>::new());

    // A second DEL after a full ADD/DEL finds nothing left either.
    f.w.calico(&inv, &f.conf).assert_ok();
    f.w.calico(&inv.as_del(), &f.conf).assert_ok();
    f.w.calico(&inv.as_del(), &f.conf).assert_ok();
    assert_eq!(f.calls(), ["ADD", "DEL"]);
    f.w.assert_clean();
}

/// An ADD that fails after the plugin gave an address (the pod already has an `eth0`)
/// releases it with what DEL sends (the recorded address and subnet), and forgets it.
#[test]
fn a_failed_add_releases_through_the_recorded_address() {
    let f = Fixture::new("rollback");
    let pod = f.w.pod();
    pod.ip(&[
        "link", "add", "eth0", "type", "veth", "peer", "name", "keep0",
    ]);
    let inv = f.add("azroll1", &pod);
    let err = f.w.calico(&inv, &f.conf).assert_err();
    assert_eq!(err["msg"], "file exists", "{err}");
    assert_eq!(f.calls(), ["ADD", "DEL"]);
    assert_eq!(
        f.sent_ipam("DEL"),
        json!({"type": "azure-vnet-ipam", "ipAddress": ADDRESS, "subnet": SUBNET})
    );
    assert!(!f.net.endpoint_file("azroll1").exists());
    f.w.assert_clean();
}

/// An ADD whose record cannot be written (the network's directory is a file) fails, and the
/// address is released at once: without the record no DEL could name it.
#[test]
fn an_add_that_cannot_record_releases_at_once() {
    let f = Fixture::new("norecord");
    std::fs::create_dir_all(NETWORKS_DIR).expect("networks dir");
    std::fs::write(f.net.dir(), "not a directory").expect("blocking file");
    let pod = f.w.pod();
    let inv = f.add("aznorec1", &pod);
    let err = f.w.calico(&inv, &f.conf).assert_err();
    assert!(
        err["msg"]
            .as_str()
            .unwrap_or_default()
            .contains("failed to create"),
        "{err}"
    );
    assert_eq!(f.calls(), ["ADD", "DEL"]);
    assert_eq!(
        f.sent_ipam("DEL"),
        json!({"type": "azure-vnet-ipam", "ipAddress": ADDRESS, "subnet": SUBNET})
    );
    std::fs::remove_file(f.net.dir()).expect("remove blocking file");
    f.w.assert_clean();
}
