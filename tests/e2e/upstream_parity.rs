//! Behaviour that must match Calico v3.32.1, from the real binary:
//! exit codes, error texts, stored keys and JSON, interfaces and routes.

use std::io::{Read, Write};
use std::net::{TcpListener, UdpSocket};
use std::time::Duration;

use crate::common::cni::Invocation;
use crate::common::world::{World, NODE, WEP_PREFIX};
use serde_json::json;

/// Item 9: a call bad in its environment and in its config gets code 4 (libcni validates
/// the environment before it reads stdin), however it is bad.
#[test]
fn environment_errors_come_before_config_errors() {
    let w = World::new();
    let pod = w.pod();
    let bad_id = Invocation::new("ADD", "-bad", pod.path());
    let err = w.calico(&bad_id, "{not json").assert_err();
    assert_eq!(
        (err["code"].as_u64(), err["msg"].as_str()),
        (Some(4), Some("invalid characters in containerID"))
    );
    let bad_if = Invocation::new("ADD", "ok1", pod.path()).ifname("a b");
    let err = w.calico(&bad_if, r#"{"cniVersion":"1.0.0"}"#).assert_err();
    assert_eq!(err["code"], 4);
    w.assert_clean();
}

/// Item 10: `dataplane_options`: an unknown type and a gRPC dataplane without a socket are
/// refused before anything is allocated, with upstream's texts. (A gRPC dataplane with a
/// socket: tests/e2e/grpc_dataplane.rs; with nothing listening, the addresses are given back.)
#[test]
fn dataplane_options_are_checked_before_ipam() {
    let w = World::new();
    let pod = w.pod();
    for (opts, want) in [
        (
            json!({"type": "invalid-dataplane-type"}),
            "invalid dataplane type: invalid-dataplane-type".to_string(),
        ),
        (
            json!({"type": "grpc"}),
            "GRPC dataplane socket not configured".to_string(),
        ),
    ] {
        for k8s in [false, true] {
            let mut inv = Invocation::new("ADD", "dp1", pod.path());
            if k8s {
                inv = inv.k8s("default", "dp");
            }
            let err = w
                .calico(&inv, &w.conf(json!({"dataplane_options": opts})))
                .assert_err();
            assert_eq!(err["msg"], want.as_str());
            w.assert_clean();
        }
    }
    let err = w
        .calico(
            &Invocation::new("ADD", "dp2", pod.path()),
            &w.conf(json!({"dataplane_options": {"type": "grpc", "socket": "unix:///run/x.sock"}})),
        )
        .assert_err();
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.starts_with(
            "rpc error: code = Unavailable desc = connection error: desc = \"transport: Error while dialing: dial unix /run/x.sock: "
        ),
        "{msg}"
    );
    assert!(!pod.has_link("eth0"));
    w.assert_clean();
}

/// A one-shot-per-connection HTTP server inside the host netns: answers `status` to every
/// request, running `on_request` first. Returns its URL.
fn http_server(w: &World, status: &'static str, on_request: impl Fn() + Send + 'static) -> String {
    let listener = w.host.run_in(|| TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { return };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            on_request();
            let _ =
                s.write_all(format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\n\r\n").as_bytes());
        }
    });
    format!("http://127.0.0.1:{port}/ready")
}

/// Items 11 and 25: readiness gates are validated and polled before IPAM; a Profile that
/// appears between our read and our create (here: created by the gate's handler) is fine.
#[test]
fn readiness_gates_and_a_profile_created_meanwhile() {
    let w = World::new();
    let pod = w.pod();
    let err = w
        .calico(
            &Invocation::new("ADD", "rg0", pod.path()),
            &w.conf(json!({"readiness_gates": ["not a url"]})),
        )
        .assert_err();
    assert_eq!(
        err["msg"],
        "invalid URL set for ReadinessGates:not a url Error:parse \"not a url\": invalid URI for request"
    );
    w.assert_clean();
    assert!(w
        .keys("/calico/resources/v3/projectcalico.org/profiles/")
        .is_empty());

    // The gate's handler creates Profile net1 (as another ADD would) before answering 200.
    let endpoint = w.etcd.endpoint();
    let host = w.host.name().to_string();
    let url = http_server(&w, "200 OK", move || {
        let profile = r#"{"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"net1","uid":"u","creationTimestamp":"2026-01-01T00:00:00Z"},"spec":{"labelsToApply":{"net1":""}}}"#;
        let _ = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &host,
                "etcdctl",
                "--endpoints",
                &endpoint,
                "put",
                "/calico/resources/v3/projectcalico.org/profiles/net1",
                profile,
            ])
            .env("ETCDCTL_API", "3")
            .output();
    });
    let conf = w.conf(json!({"readiness_gates": [url]}));
    let inv = Invocation::new("ADD", "rg1", pod.path());
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    assert!(
        out.elapsed < Duration::from_secs(5),
        "a ready gate costs no time: {:?}",
        out.elapsed
    );
    // Upstream fails this ADD ("resource already exists"); ours keeps the other's Profile.
    assert_eq!(
        w.get("/calico/resources/v3/projectcalico.org/profiles/net1")["spec"],
        json!({"labelsToApply": {"net1": ""}})
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// A readiness gate that redirects is judged by where the redirect leads, as Go's
/// `http.Client` follows it: `/ready` sends to `/next`, which answers 503 at first (not
/// ready: the next probe goes out 5 s later) and then 200.
#[test]
fn a_readiness_gate_is_judged_after_its_redirects() {
    let w = World::new();
    let pod = w.pod();
    let listener = w.host.run_in(|| TcpListener::bind("127.0.0.1:0").unwrap());
    let port = listener.local_addr().unwrap().port();
    let answers = [
        "302 Found\r\nLocation: /next",
        "503 Service Unavailable",
        "302 Found\r\nLocation: /next",
        "200 OK",
    ];
    let server = std::thread::spawn(move || {
        let mut asked = Vec::new();
        for answer in answers {
            let Ok((mut s, _)) = listener.accept() else {
                break;
            };
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).unwrap_or(0);
            let request = String::from_utf8_lossy(&buf[..n]).into_owned();
            asked.push(request.lines().next().unwrap_or_default().to_string());
            let _ =
                s.write_all(format!("HTTP/1.1 {answer}\r\nContent-Length: 0\r\n\r\n").as_bytes());
        }
        asked
    });
    let conf = w.conf(json!({"readiness_gates": [format!("http://127.0.0.1:{port}/ready")]}));
    let inv = Invocation::new("ADD", "rg2", pod.path());
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    assert!(
        out.elapsed >= Duration::from_secs(5) && out.elapsed < Duration::from_secs(15),
        "one probe after the 503: {:?}",
        out.elapsed
    );
    assert_eq!(
        server.join().unwrap(),
        [
            "GET /ready HTTP/1.1",
            "GET /next HTTP/1.1",
            "GET /ready HTTP/1.1",
            "GET /next HTTP/1.1"
        ]
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Item 12: `policy_setup_timeout_seconds` (k8s): a negative value is refused before IPAM;
/// a positive one waits for Felix's status file, and only so long.
#[test]
fn policy_setup_timeout_waits_for_the_status_file() {
    let w = World::new();
    let pod = w.pod();
    let inv = Invocation::new("ADD", "pst1", pod.path()).k8s("ns1", "web-1");
    let err = w
        .calico(&inv, &w.conf(json!({"policy_setup_timeout_seconds": -1})))
        .assert_err();
    assert_eq!(err["msg"], "invalid pod startup delay of -1");
    w.assert_clean();

    let dir = w.scratch.path().join("endpoint-status");
    std::fs::create_dir_all(&dir).unwrap();
    let conf = w.conf(json!({"policy_setup_timeout_seconds": 2,
        "endpoint_status_dir": dir.display().to_string()}));
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    assert!(out.elapsed >= Duration::from_secs(2), "{:?}", out.elapsed);
    w.calico(&inv.as_del(), &conf).assert_ok();
    // Felix has written the status file: no wait.
    let status_file = dir.join("k8s ns1%2Fweb-1 eth0");
    std::fs::write(&status_file, "").unwrap();
    let out = w.calico(&inv, &conf);
    out.assert_ok();
    assert!(out.elapsed < Duration::from_secs(2), "{:?}", out.elapsed);
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();

    // A wait longer than the call's deadline is not cut short by it: the deadline grows to
    // cover it (here 2 s of budget, a 6 s wait, Felix done after 3 s).
    std::fs::remove_file(&status_file).unwrap();
    let conf = w.conf(
        json!({"policy_setup_timeout_seconds": 6, "call_timeout_seconds": 2,
        "endpoint_status_dir": dir.display().to_string()}),
    );
    let felix = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(3));
        std::fs::write(&status_file, "").unwrap();
    });
    let out = w.calico(&inv, &conf);
    felix.join().unwrap();
    out.assert_ok();
    assert!(
        out.elapsed >= Duration::from_secs(3) && out.elapsed < Duration::from_secs(6),
        "{:?}",
        out.elapsed
    );
    assert!(
        out.stderr.contains("endpoint policy is programmed"),
        "{}",
        out.stderr
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Item 13: objects libcalico-go's validator refuses are never stored; the ADD fails with
/// its text, before anything is allocated (upstream: after IPAM and networking).
#[test]
fn invalid_endpoints_and_profiles_are_refused_before_ipam() {
    let w = World::new();
    let pod = w.pod();
    let err = w
        .calico(
            &Invocation::new("ADD", "v1", pod.path()),
            &w.conf(json!({"name": "Net1"})),
        )
        .assert_err();
    assert_eq!(
        err["msg"],
        "error with field Profiles[0] = 'Net1' (Reason: failed to validate Field: Profiles[0] because of Tag: name )"
    );
    // A valid lower-case name too long for a label key: the Profile's labelsToApply.
    let long = "n".repeat(70);
    let err = w
        .calico(
            &Invocation::new("ADD", "v2", pod.path()),
            &w.conf(json!({"name": long})),
        )
        .assert_err();
    assert_eq!(
        err["msg"],
        format!("error with field LabelsToApply = 'map[{long}:]' (Reason: failed to validate Field: LabelsToApply because of Tag: labels )")
    );
    assert!(!pod.has_link("eth0"));
    assert!(w
        .keys("/calico/resources/v3/projectcalico.org/profiles/")
        .is_empty());
    w.assert_clean();
}

/// Items 16 and 24: `device_type` is not a v3.32.1 key (ignored); type mismatches Go's
/// decoder rejects are rejected with its text (code 999, as upstream's cmdAdd error).
#[test]
fn netconf_keys_and_types_as_go_decodes_them() {
    let w = World::new();
    let pod = w.pod();
    let inv = Invocation::new("ADD", "dt1", pod.path());
    let conf = w.conf(json!({"device_type": "bogus"}));
    w.calico(&inv, &conf).assert_ok();
    w.calico(&inv.as_del(), &conf).assert_ok();
    for (extra, want) in [
        (json!({"kubernetes": []}), "failed to load netconf: json: cannot unmarshal array into Go struct field NetConf.kubernetes of type types.Kubernetes"),
        (json!({"policy": ["k8s"]}), "failed to load netconf: json: cannot unmarshal array into Go struct field NetConf.policy of type types.Policy"),
        (json!({"feature_control": []}), "failed to load netconf: json: cannot unmarshal array into Go struct field NetConf.feature_control of type types.FeatureControl"),
        (json!({"container_settings": []}), "failed to load netconf: json: cannot unmarshal array into Go struct field NetConf.container_settings of type types.ContainerSettings"),
        (json!({"args": 5}), "failed to load netconf: json: cannot unmarshal number into Go struct field NetConf.args of type types.Args"),
    ] {
        let err = w.calico(&Invocation::new("ADD", "ty1", pod.path()), &w.conf(extra)).assert_err();
        assert_eq!((err["code"].as_u64(), err["msg"].as_str()), (Some(999), Some(want)));
        let err = w.calico(&Invocation::new("DEL", "ty1", pod.path()), &w.conf(json!({"args": 5}))).assert_err();
        assert_eq!(err["code"], 999);
    }
    w.assert_clean();
}

/// Item 17: calico-ipam run directly parses CNI_ARGS a second time knowing only
/// IgnoreUnknown and IP, so K8S_* keys without IgnoreUnknown fail its ADD (not its DEL).
#[test]
fn calico_ipam_refuses_unknown_args_without_ignore_unknown() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let inv = Invocation::new("ADD", "ia1", "/dev/null").k8s("default", "ia");
    let err = w.ipam(&inv, &conf).assert_err();
    assert_eq!(
        err["msg"],
        "ARGS: unknown args [\"K8S_POD_NAMESPACE=default\" \"K8S_POD_NAME=ia\" \"K8S_POD_INFRA_CONTAINER_ID=ia1\"]"
    );
    w.ipam(&inv.as_del(), &conf).assert_ok();
    w.ipam(&inv.clone().via_calico(), &conf).assert_ok();
    w.ipam(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Item 18: upstream's texts for a bad `IP=` value, a missing Node, and `IP=` into a
/// block affine to another host under strict affinity.
#[test]
fn error_texts_as_upstream() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    for args in ["IP=abc", "IP=10.0.0.300"] {
        let want = format!(
            "ARGS: error parsing value of pair \"{args}\": invalid IP address: {}",
            &args[3..]
        );
        let err = w
            .ipam(
                &Invocation::new("ADD", "e1", "/dev/null").with_args(args),
                &conf,
            )
            .assert_err();
        assert_eq!(err["msg"], want.as_str());
        // calico parses `IP` itself too (types.K8sArgs), before anything else.
        let err = w
            .calico(
                &Invocation::new("ADD", "e1", pod.path()).with_args(args),
                &conf,
            )
            .assert_err();
        assert_eq!(err["msg"], want.as_str());
    }
    // A block of 10.65.7.0/26 affine to node2, strict affinity: IP= refused.
    w.seed_node("node2");
    let conf2 = w.conf(json!({"nodename": "node2"}));
    let other = w.pod();
    let inv2 = Invocation::new("ADD", "e2", other.path()).with_args("IP=10.65.7.7");
    w.calico(&inv2, &conf2).assert_ok();
    w.etcd.put(
        "/calico/ipam/v2/config",
        r#"{"strict_affinity":true,"auto_allocate_blocks":true}"#,
    );
    let err = w
        .calico(
            &Invocation::new("ADD", "e3", pod.path()).with_args("IP=10.65.7.8"),
            &conf,
        )
        .assert_err();
    assert_eq!(err["msg"], "Block host affinity does not match");
    w.calico(&inv2.as_del(), &conf2).assert_ok();
    w.assert_clean();
    // No Node object: the datastore's error as it is.
    w.etcd.etcdctl(&[
        "del",
        &format!("/calico/resources/v3/projectcalico.org/nodes/{NODE}"),
    ]);
    let err = w
        .calico(&Invocation::new("ADD", "e4", pod.path()), &conf)
        .assert_err();
    assert_eq!(
        err["msg"],
        "resource does not exist: Node(node1) with error: <nil>"
    );
    w.assert_clean();
}

/// Item 19: logging as v3.32.1's ConfigureLogging: stderr at `log_level` (debug, info or
/// error), a file only where `log_file_path` is set.
#[test]
fn logging_levels_and_no_default_file() {
    let w = World::new();
    let pod = w.pod();
    let default_log = std::path::Path::new("/var/log/calico/cni/cni.log");
    let existed = default_log.exists();
    let inv = Invocation::new("ADD", "log1", pod.path());
    let info = w.conf(json!({"log_level": "info", "log_file_path": null}));
    let out = w.calico(&inv, &info);
    out.assert_ok();
    assert!(
        out.stderr.contains("[INFO]") && !out.stderr.contains("[DEBUG]"),
        "{}",
        out.stderr
    );
    // Only our own events: no line from the libraries underneath.
    assert!(
        out.stderr
            .lines()
            .all(|l| l.contains(" cni-plugin/") || l.contains(" ipam/") || l.is_empty()),
        "{}",
        out.stderr
    );
    let quiet = w.conf(json!({"log_level": "error", "log_file_path": null}));
    let out = w.calico(&inv.as_del(), &quiet);
    out.assert_ok();
    assert_eq!(out.stderr, "");
    if !existed {
        assert!(
            !default_log.exists(),
            "a log file was written without log_file_path"
        );
    }
    w.assert_clean();
}

/// Item 20: a re-ADD of an existing k8s endpoint rebuilds the fields upstream rebuilds.
#[test]
fn re_add_resets_what_upstream_rebuilds() {
    let w = World::new();
    let conf = w.conf(json!({}));
    let pod = w.pod();
    let key = format!("{WEP_PREFIX}default/node1-k8s-stale-eth0");
    w.etcd.put(&key, &json!({"kind":"WorkloadEndpoint","apiVersion":"projectcalico.org/v3",
        "metadata":{"name":"node1-k8s-stale-eth0","generateName":"stale-","namespace":"default","uid":"u1",
            "creationTimestamp":"2026-01-01T00:00:00Z","labels":{"app":"old","projectcalico.org/namespace":"default"},
            "annotations":{"keep":"me"}},
        "spec":{"orchestrator":"k8s","node":NODE,"containerID":"old","pod":"stale","endpoint":"eth0",
            "serviceAccountName":"old-sa","ipNetworks":["10.65.99.1/32"],"profiles":["kns.default","old"],
            "interfaceName":"caliold","mac":"ee:00:00:00:00:01",
            "ports":[{"name":"http","protocol":"TCP","port":80,"hostPort":0,"hostIP":""}],
            "allowSpoofedSourcePrefixes":["8.8.8.8/32"],"futureField":1}}).to_string());
    let inv = Invocation::new("ADD", "new1", pod.path()).k8s("default", "stale");
    let r = w.calico(&inv, &conf).assert_ok().json();
    let ip = r["ips"][0]["address"].as_str().unwrap().to_string();
    let wep = w.get(&key);
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"default","projectcalico.org/orchestrator":"k8s"})
    );
    assert!(wep["metadata"].get("generateName").is_none());
    assert_eq!(wep["metadata"]["annotations"], json!({"keep":"me"}));
    assert_eq!(wep["metadata"]["uid"], "u1");
    let spec = &wep["spec"];
    assert_eq!(spec["containerID"], "new1");
    assert_eq!(spec["ipNetworks"], json!([ip]));
    assert_eq!(spec["profiles"], json!(["net1"]));
    assert_eq!(spec["interfaceName"], r["interfaces"][0]["name"]);
    for gone in ["serviceAccountName", "ports", "allowSpoofedSourcePrefixes"] {
        assert!(spec.get(gone).is_none(), "{gone} kept: {spec}");
    }
    assert_eq!(spec["futureField"], 1, "unknown fields survive");
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// Item 21 (calico's side; the `dst`-less entry itself is unit-tested in `plugin::add`,
/// because host-local echoes such a route back as `"dst": "<nil>"`, which libcni refuses
/// upstream too): host-local's routes become pod routes via 169.254.1.1, after the
/// defaults with `include_default_routes`.
#[test]
fn host_local_routes_become_pod_routes() {
    let w = World::new();
    let data = w.scratch.path().join("host-local");
    let conf = w.conf(json!({"include_default_routes": true,
        "ipam": {"type": "host-local", "subnet": "10.66.0.0/24",
        "dataDir": data.display().to_string(), "routes": [{"dst": "10.123.0.0/16"}]}}));
    let pod = w.pod();
    let inv = Invocation::new("ADD", "hlr1", pod.path()).k8s("default", "hlr");
    w.calico(&inv, &conf).assert_ok();
    let routes = pod.sh("ip route show");
    assert!(
        routes.contains("10.123.0.0/16 via 169.254.1.1 dev eth0"),
        "{routes}"
    );
    assert!(
        routes.contains("default via 169.254.1.1 dev eth0"),
        "{routes}"
    );
    w.calico(&inv.as_del(), &conf).assert_ok();
    w.assert_clean();
}

/// A tiny DNS server inside the host netns (127.0.0.1:53, named by the netns's own
/// resolv.conf, which `ip netns exec` mounts): SRV records for `_etcd-client._tcp.<zone>`
/// pointing at `localhost.:<port>`, A 127.0.0.1 for `localhost.`, NXDOMAIN for the rest.
struct Dns {
    dir: std::path::PathBuf,
}

impl Dns {
    fn start(w: &World, zone: &'static str, port: u16) -> Dns {
        let dir = std::path::PathBuf::from(format!("/etc/netns/{}", w.host.name()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("resolv.conf"), "nameserver 127.0.0.1\n").unwrap();
        let sock = w.host.run_in(|| UdpSocket::bind("127.0.0.1:53").unwrap());
        std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while let Ok((n, from)) = sock.recv_from(&mut buf) {
                let _ = sock.send_to(&dns_answer(&buf[..n], zone, port), from);
            }
        });
        Dns { dir }
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The answer to one query (question copied, pointer to it for the answer's name).
fn dns_answer(q: &[u8], zone: &str, port: u16) -> Vec<u8> {
    let mut name = Vec::new();
    let mut i = 12;
    while q[i] != 0 {
        let len = q[i] as usize;
        name.push(String::from_utf8_lossy(&q[i + 1..i + 1 + len]).to_string());
        i += 1 + len;
    }
    let qtype = u16::from_be_bytes([q[i + 1], q[i + 2]]);
    let name = name.join(".");
    let mut m = q[..i + 5].to_vec();
    m[2] = 0x81;
    m[3] = 0x80;
    let rdata: Option<Vec<u8>> = if qtype == 33 && name == format!("_etcd-client._tcp.{zone}") {
        let mut r = vec![0, 0, 0, 0];
        r.extend_from_slice(&port.to_be_bytes());
        r.extend_from_slice(b"\x09localhost\x00");
        Some(r)
    } else if qtype == 1 && name == "localhost" {
        Some(vec![127, 0, 0, 1])
    } else if name == "localhost" {
        None
    } else {
        m[3] = 0x83; // NXDOMAIN
        None
    };
    if let Some(r) = rdata {
        m[7] = 1;
        m.extend_from_slice(&[0xc0, 12]);
        m.extend_from_slice(&qtype.to_be_bytes());
        m.extend_from_slice(&[0, 1, 0, 0, 0, 30]);
        m.extend_from_slice(&(r.len() as u16).to_be_bytes());
        m.extend_from_slice(&r);
    }
    m
}

/// Item 23: etcd found through DNS SRV discovery (`etcd_discovery_srv` with the etcdv3
/// datastore), upstream's errors when it is not, and `CALICO_`-prefixed variables beating
/// the NetConf.
#[test]
fn etcd_discovery_and_settings_precedence() {
    let w = World::new();
    let port: u16 = w
        .etcd
        .endpoint()
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let _dns = Dns::start(&w, "cluster.test", port);
    let pod = w.pod();
    let inv = Invocation::new("ADD", "srv1", pod.path());
    let conf = w.conf(json!({"etcd_endpoints": null, "datastore_type": "etcdv3",
        "etcd_discovery_srv": "cluster.test"}));
    w.calico(&inv, &conf).assert_ok();
    w.calico(&inv.as_del(), &conf).assert_ok();

    let nowhere = w.conf(json!({"etcd_endpoints": null, "datastore_type": "etcdv3",
        "etcd_discovery_srv": "nowhere.test"}));
    let err = w.calico(&inv, &nowhere).assert_err();
    assert_eq!(
        err["msg"],
        "error creating calico client: failed to discover etcd endpoints through SRV discovery: dns lookup errors: lookup _etcd-client-ssl._tcp.nowhere.test on 127.0.0.1:53: no such host and lookup _etcd-client._tcp.nowhere.test on 127.0.0.1:53: no such host"
    );
    let both = w.conf(json!({"etcd_discovery_srv": "cluster.test"}));
    let err = w.calico(&inv, &both).assert_err();
    assert_eq!(
        err["msg"],
        "error creating calico client: multiple discovery or bootstrap options specified, use either \"etcdEndpoints\" or \"etcdDiscoverySrv\""
    );
    // CALICO_ETCD_ENDPOINTS in the environment beats the NetConf's (dead) endpoints.
    let mut env_inv = inv.clone();
    env_inv
        .extra_env
        .push(("CALICO_ETCD_ENDPOINTS".into(), w.etcd.endpoint()));
    let dead = w.conf(json!({"etcd_endpoints": "http://127.0.0.1:1"}));
    w.calico(&env_inv, &dead).assert_ok();
    w.calico(&env_inv.as_del(), &dead).assert_ok();
    w.assert_clean();
}
