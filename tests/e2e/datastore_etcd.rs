//! The etcd backend against a real etcd: key paths, create/CAS update/CAS delete semantics,
//! what is stored byte for byte, and bounded failure when etcd is down.

use std::time::{Duration, Instant};

use crate::common;
use crate::common::etcd::EtcdServer;
use calico_cni::datastore::etcd::{EtcdConfig, EtcdDatastore};
use calico_cni::datastore::model::{ProfileSpec, Resource, WorkloadEndpointSpec};
use calico_cni::datastore::resources::{
    create_resource, get_resource, list_resources, update_resource,
};
use calico_cni::datastore::{Datastore, DatastoreError, Key, Kind, ListKind};
use serde_json::json;

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn connect(endpoint: &str) -> EtcdDatastore {
    common::etcd::connect(endpoint, Duration::from_secs(2)).await
}

#[test]
fn create_update_delete_semantics() {
    let etcd = EtcdServer::start();
    let rt = rt();
    rt.block_on(async {
        let ds = connect(&etcd.endpoint()).await;
        let key = Key::Handle {
            id: "net1.ABC".into(),
        };
        assert!(matches!(
            ds.get(&key).await,
            Err(DatastoreError::NotFound { .. })
        ));
        let r1 = ds
            .create(&key, &json!({"block":{"10.0.0.0/26":1},"deleted":false}))
            .await
            .unwrap();
        assert!(matches!(
            ds.create(&key, &json!({})).await,
            Err(DatastoreError::AlreadyExists(_))
        ));
        let kv = ds.get(&key).await.unwrap();
        assert_eq!(kv.revision, r1);
        let r2 = ds
            .update(
                &key,
                &json!({"block":{"10.0.0.0/26":2},"deleted":false}),
                &r1,
            )
            .await
            .unwrap();
        assert_ne!(r1, r2);
        // A stale revision is a conflict; a missing key is not found.
        assert!(ds
            .update(&key, &json!({}), &r1)
            .await
            .unwrap_err()
            .is_conflict());
        assert!(ds.delete(&key, Some(&r1)).await.unwrap_err().is_conflict());
        let gone = Key::Handle { id: "nope".into() };
        assert!(ds
            .update(&gone, &json!({}), "5")
            .await
            .unwrap_err()
            .is_not_found());
        assert!(ds.delete(&gone, None).await.unwrap_err().is_not_found());
        ds.delete(&key, Some(&r2)).await.unwrap();
        assert!(ds.get(&key).await.unwrap_err().is_not_found());
    });
    assert!(etcd.keys("/calico/ipam/v2/handle/").is_empty());
}

#[test]
fn create_and_update_writes_both_or_neither() {
    let etcd = EtcdServer::start();
    let rt = rt();
    rt.block_on(async {
        let ds = connect(&etcd.endpoint()).await;
        let block = Key::Block {
            cidr: "10.0.0.0/26".parse().unwrap(),
        };
        let handle = |id: &str| Key::Handle { id: id.into() };
        let h1 = json!({"block":{"10.0.0.0/26":1},"deleted":false});
        let b0 = ds
            .create(&block, &json!({"cidr":"10.0.0.0/26","seq":0}))
            .await
            .unwrap();
        let b1 = json!({"cidr":"10.0.0.0/26","seq":1});
        // Both written, at one revision.
        let rev = ds
            .create_and_update((&handle("a"), &h1), (&block, &b1, &b0))
            .await
            .expect("etcd writes two keys at once")
            .unwrap();
        assert_eq!(ds.get(&handle("a")).await.unwrap().revision, rev);
        let stored = ds.get(&block).await.unwrap();
        assert_eq!(
            (stored.revision.as_str(), &stored.value),
            (rev.as_str(), &b1)
        );
        // A stale block revision, an existing handle, a missing block: nothing written, and
        // the refusal names the first compare that failed.
        let b2 = json!({"cidr":"10.0.0.0/26","seq":2});
        let e = ds
            .create_and_update((&handle("b"), &h1), (&block, &b2, &b0))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.is_conflict(), "{e}");
        assert!(ds.get(&handle("b")).await.unwrap_err().is_not_found());
        let e = ds
            .create_and_update((&handle("a"), &h1), (&block, &b2, &rev))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.is_already_exists(), "{e}");
        assert_eq!(ds.get(&block).await.unwrap().value, b1);
        let other = Key::Block {
            cidr: "10.0.0.64/26".parse().unwrap(),
        };
        let e = ds
            .create_and_update((&handle("c"), &h1), (&other, &b2, &rev))
            .await
            .unwrap()
            .unwrap_err();
        assert!(e.is_not_found(), "{e}");
        assert!(ds.get(&handle("c")).await.unwrap_err().is_not_found());
    });
    assert_eq!(etcd.keys("/calico/ipam/v2/handle/").len(), 1);
}

#[test]
fn stored_bytes_and_lists() {
    let etcd = EtcdServer::start();
    rt().block_on(async {
        let ds = connect(&etcd.endpoint()).await;
        let key = Key::Handle {
            id: "k8s-pod-network.Abc".into(),
        };
        ds.create(&key, &json!({"block":{"10.0.0.0/26":1},"deleted":false}))
            .await
            .unwrap();
        let cidr = "fd00:10:244::/122".parse().unwrap();
        ds.create(
            &Key::host_affinity("node1", cidr),
            &json!({"state":"pending","deleted":false}),
        )
        .await
        .unwrap();
        let mut wep: Resource<WorkloadEndpointSpec> = Resource::new(
            "WorkloadEndpoint",
            "node1-k8s-p-eth0",
            Some("ns1"),
            Default::default(),
        );
        wep.spec.orchestrator = "k8s".into();
        wep.spec.pod = "p".into();
        create_resource(&ds, Kind::WorkloadEndpoint, &mut wep)
            .await
            .unwrap();
        assert!(!wep.metadata.resource_version.is_empty());
        // Update through the clientv3 layer: CAS on the resourceVersion it carries.
        let stale = wep.clone();
        wep.spec.mac = "aa:bb:cc:dd:ee:ff".into();
        update_resource(&ds, Kind::WorkloadEndpoint, &mut wep)
            .await
            .unwrap();
        let mut stale = stale;
        assert!(update_resource(&ds, Kind::WorkloadEndpoint, &mut stale)
            .await
            .unwrap_err()
            .is_conflict());
        let got: Resource<WorkloadEndpointSpec> =
            get_resource(&ds, Kind::WorkloadEndpoint, Some("ns1"), "node1-k8s-p-eth0")
                .await
                .unwrap();
        assert_eq!(got.metadata.resource_version, wep.metadata.resource_version);
        let listed: Vec<Resource<WorkloadEndpointSpec>> = list_resources(
            &ds,
            &ListKind::Resources {
                kind: Kind::WorkloadEndpoint,
                namespace: Some("ns1".into()),
                name_prefix: Some("node1-k8s-p-".into()),
            },
        )
        .await
        .unwrap();
        assert_eq!(listed.len(), 1);
        let affs = ds
            .list(&ListKind::Affinities {
                host: "node1".into(),
                affinity_type: "host".into(),
                version: Some(6),
            })
            .await
            .unwrap();
        assert_eq!(affs[0].key, Key::host_affinity("node1", cidr));
        let mut profile: Resource<ProfileSpec> =
            Resource::new("Profile", "net1", None, Default::default());
        create_resource(&ds, Kind::Profile, &mut profile)
            .await
            .unwrap();
    });
    assert_eq!(
        etcd.get_raw("/calico/ipam/v2/handle/k8s-pod-network.Abc")
            .unwrap(),
        r#"{"block":{"10.0.0.0/26":1},"deleted":false}"#
    );
    assert_eq!(
        etcd.get_raw("/calico/ipam/v2/host/node1/ipv6/block/fd00:10:244::-122")
            .unwrap(),
        r#"{"state":"pending","deleted":false}"#
    );
    let wep = etcd
        .get_json("/calico/resources/v3/projectcalico.org/workloadendpoints/ns1/node1-k8s-p-eth0");
    assert_eq!(wep["kind"], "WorkloadEndpoint");
    assert_eq!(wep["apiVersion"], "projectcalico.org/v3");
    assert!(wep["metadata"].get("resourceVersion").is_none());
    assert_eq!(wep["metadata"]["namespace"], "ns1");
    assert_eq!(wep["spec"]["mac"], "aa:bb:cc:dd:ee:ff");
    assert_eq!(
        wep["metadata"]["labels"],
        json!({"projectcalico.org/namespace":"ns1","projectcalico.org/orchestrator":"k8s"})
    );
    let raw = etcd
        .get_raw("/calico/resources/v3/projectcalico.org/profiles/net1")
        .unwrap();
    assert!(raw.starts_with(r#"{"kind":"Profile","apiVersion":"projectcalico.org/v3","metadata":{"name":"net1","uid":""#), "{raw}");
}

#[test]
fn pool_defaults_on_read() {
    let etcd = EtcdServer::start();
    etcd.put(
        "/calico/resources/v3/projectcalico.org/ippools/p6",
        r#"{"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"p6"},"spec":{"cidr":"fd00::/64"}}"#,
    );
    let pool: calico_cni::datastore::model::IpPool = rt()
        .block_on(async {
            let ds = connect(&etcd.endpoint()).await;
            get_resource(&ds, Kind::IpPool, None, "p6").await
        })
        .unwrap();
    assert_eq!(pool.spec.block_size, 122);
    assert_eq!(pool.spec.node_selector, "all()");
    assert_eq!(pool.spec.allowed_uses, ["Workload", "Tunnel"]);
    assert_eq!(pool.spec.assignment_mode, "Automatic");
    // Nothing was written back.
    assert!(!etcd
        .get_raw("/calico/resources/v3/projectcalico.org/ippools/p6")
        .unwrap()
        .contains("blockSize"));
}

#[test]
fn unreachable_etcd_fails_within_the_timeout() {
    let start = Instant::now();
    let r = rt().block_on(async {
        let ds = EtcdDatastore::connect(&EtcdConfig {
            endpoints: vec!["http://127.0.0.1:1".into()],
            timeout: Duration::from_secs(2),
            ..Default::default()
        })
        .await?;
        ds.get(&Key::IpamConfig).await.map(|_| ())
    });
    // A refused connection, tried on every attempt: etcd's client error, kept with its type.
    assert!(matches!(r, Err(DatastoreError::Client(_))), "{r:?}");
    assert!(r.as_ref().is_err_and(DatastoreError::outcome_unknown));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn tls_with_client_certificates() {
    let etcd = EtcdServer::start_tls();
    let files = etcd.tls_files().unwrap();
    assert!(etcd.endpoint().starts_with("https://"));
    rt().block_on(async {
        let cfg = EtcdConfig {
            endpoints: vec![etcd.endpoint()],
            ca_cert_file: Some(files.ca.clone()),
            cert_file: Some(files.cert.clone()),
            key_file: Some(files.key.clone()),
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let ds = EtcdDatastore::connect(&cfg).await.unwrap();
        let key = Key::Handle { id: "tls".into() };
        ds.create(&key, &json!({"block":{},"deleted":false}))
            .await
            .unwrap();
        assert_eq!(ds.get(&key).await.unwrap().value["deleted"], false);
        // Without a client certificate the server refuses: an error, not a hang.
        let start = Instant::now();
        let no_cert = EtcdConfig {
            cert_file: None,
            key_file: None,
            timeout: Duration::from_secs(2),
            ..cfg.clone()
        };
        let r = match EtcdDatastore::connect(&no_cert).await {
            Ok(ds) => ds.get(&key).await.map(|_| ()),
            Err(e) => Err(e),
        };
        assert!(r.is_err());
        assert!(start.elapsed() < Duration::from_secs(10));
    });
    assert_eq!(
        etcd.keys("/calico/ipam/v2/handle/"),
        ["/calico/ipam/v2/handle/tls"]
    );
}

/// Node `node1` and pool `p` of `cidr`: what a calico-ipam ADD on node1 needs.
fn seed_node_and_pool(etcd: &EtcdServer, cidr: &str) {
    etcd.put(
        "/calico/resources/v3/projectcalico.org/nodes/node1",
        r#"{"kind":"Node","apiVersion":"projectcalico.org/v3","metadata":{"name":"node1"},"spec":{}}"#,
    );
    etcd.put(
        "/calico/resources/v3/projectcalico.org/ippools/p",
        &json!({"kind":"IPPool","apiVersion":"projectcalico.org/v3","metadata":{"name":"p"},"spec":{"cidr":cidr}}).to_string(),
    );
}

/// The NetConf's etcd_*_file fields reach the TLS client: calico-ipam ADD/DEL over mTLS.
#[test]
fn calico_ipam_over_tls_from_netconf() {
    let etcd = EtcdServer::start_tls();
    let files = etcd.tls_files().unwrap();
    seed_node_and_pool(&etcd, "10.90.0.0/24");
    let bin = common::cni::Bin::new();
    let scratch = common::cni::TempDir::new("tls");
    let conf = json!({"cniVersion":"1.0.0","name":"net1","etcd_endpoints":etcd.endpoint(),
        "etcd_ca_cert_file":files.ca,"etcd_cert_file":files.cert,"etcd_key_file":files.key,
        "nodename":"node1","log_file_path":scratch.path().join("cni.log").display().to_string(),
        "ipam_lock_file":scratch.path().join("lock").display().to_string(),"ipam":{"type":"calico-ipam"}})
    .to_string();
    let run = |cmd: &str| {
        common::cni::run_plugin(
            &bin.plugin("calico-ipam"),
            &bin.path(),
            None,
            &common::cni::Invocation::new(cmd, "tls1", "/dev/null"),
            &conf,
        )
    };
    let r = run("ADD").assert_ok().json();
    assert!(r["ips"][0]["address"]
        .as_str()
        .unwrap()
        .starts_with("10.90.0."));
    assert_eq!(
        etcd.keys("/calico/ipam/v2/handle/"),
        ["/calico/ipam/v2/handle/net1.tls1"]
    );
    run("DEL").assert_ok();
    assert!(etcd.keys("/calico/ipam/v2/handle/").is_empty());
}

/// A member that refuses connections, listed before a live one (a dead member of a cluster):
/// every calico-ipam ADD and DEL succeeds, and an attempt the dead member refused is sent to
/// the live one at once, without the back-off a timeout or an unavailable member gets.
#[test]
fn a_refusing_member_is_passed_over_without_waiting() {
    let etcd = EtcdServer::start();
    seed_node_and_pool(&etcd, "10.91.0.0/24");
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let bin = common::cni::Bin::new();
    let scratch = common::cni::TempDir::new("refusing-member");
    let log = scratch.path().join("cni.log");
    let conf = json!({"cniVersion":"1.0.0","name":"net1",
        "etcd_endpoints":format!("http://127.0.0.1:{closed},{}", etcd.endpoint()),
        "nodename":"node1","log_level":"debug","log_file_path":log.display().to_string(),
        "ipam_lock_file":scratch.path().join("lock").display().to_string(),"ipam":{"type":"calico-ipam"}})
    .to_string();
    let run = |cmd: &str, cid: &str| {
        common::cni::run_plugin(
            &bin.plugin("calico-ipam"),
            &bin.path(),
            None,
            &common::cni::Invocation::new(cmd, cid, "/dev/null"),
            &conf,
        )
    };
    for i in 0..10 {
        let cid = format!("c{i}");
        run("ADD", &cid).assert_ok();
        run("DEL", &cid).assert_ok();
    }
    assert!(etcd.keys("/calico/ipam/v2/handle/").is_empty());
    let text = std::fs::read_to_string(&log).unwrap();
    let retries: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("etcd transport error; retrying"))
        .collect();
    // One in two requests, about, goes first to the refusing member (the balancer picks
    // between the two): in 20 calls of several requests each, some must have.
    assert!(
        !retries.is_empty(),
        "no request met the refusing member:\n{text}"
    );
    for r in &retries {
        assert!(r.contains("Connection refused"), "{r}");
        assert!(r.contains("backoff=0ns"), "a refused attempt waited: {r}");
    }
}

/// Requests etcd answered, by KV method, since `before`.
fn requests_since(
    etcd: &EtcdServer,
    before: &std::collections::BTreeMap<String, u64>,
) -> Vec<(String, u64)> {
    etcd.kv_requests()
        .into_iter()
        .map(|(m, n)| (m.clone(), n - before.get(&m).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Reads made together (one `join!`) go as one read-only transaction, at most 16 reads
/// each, with the answers each read alone gets; a lone read stays one range request; a read
/// whose batch was taken by a future that was then dropped is sent again on its own.
#[test]
fn reads_made_together_are_one_request_with_the_same_answers() {
    let etcd = EtcdServer::start();
    rt().block_on(async {
        let ds = connect(&etcd.endpoint()).await;
        let handles: Vec<Key> = (0..40)
            .map(|i| Key::Handle {
                id: format!("net1.c{i:02}"),
            })
            .collect();
        for (i, k) in handles.iter().enumerate() {
            ds.create(k, &json!({"block":{"10.0.0.0/26":i},"deleted":false}))
                .await
                .unwrap();
        }
        let missing = Key::Handle {
            id: "net1.none".into(),
        };
        let mut alone = Vec::new();
        for k in &handles {
            alone.push(ds.get(k).await.unwrap());
        }
        let listed_alone = ds.list(&ListKind::Handles).await.unwrap();

        let before = etcd.kv_requests();
        let (one, none, listed) = tokio::join!(
            ds.get(&handles[0]),
            ds.get(&missing),
            ds.list(&ListKind::Handles)
        );
        assert_eq!(requests_since(&etcd, &before), [("Txn".to_string(), 1)]);
        assert_eq!(one.unwrap(), alone[0]);
        assert!(
            matches!(none, Err(DatastoreError::NotFound { .. })),
            "{none:?}"
        );
        assert_eq!(listed.unwrap(), listed_alone);

        // 40 reads at once: three transactions (16 + 16 + 8).
        let before = etcd.kv_requests();
        let many = futures::future::join_all(handles.iter().map(|k| ds.get(k))).await;
        assert_eq!(requests_since(&etcd, &before), [("Txn".to_string(), 3)]);
        let many: Vec<_> = many.into_iter().map(Result::unwrap).collect();
        assert_eq!(many, alone);

        let before = etcd.kv_requests();
        assert_eq!(ds.get(&handles[1]).await.unwrap(), alone[1]);
        assert_eq!(requests_since(&etcd, &before), [("Range".to_string(), 1)]);

        // The future that took both reads is dropped mid-request: the other read is answered.
        let mut first = Box::pin(ds.get(&handles[2]));
        let mut second = Box::pin(ds.get(&handles[3]));
        assert!(futures::poll!(first.as_mut()).is_pending());
        assert!(futures::poll!(second.as_mut()).is_pending());
        assert!(futures::poll!(first.as_mut()).is_pending());
        drop(first);
        assert_eq!(second.await.unwrap(), alone[3]);
    });
}
