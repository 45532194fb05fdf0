//! Self-tests of the Kubernetes API test server (tests/common/kube_api): transport (TLS, h2
//! and HTTP/1.1, bearer auth), the REST semantics and error texts a Calico client relies on,
//! and fault injection. Driven with curl, the way an outside client sees the server.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common;
use crate::common::kube_api::KubeApi;
use serde_json::{json, Value};

const POOLS: &str = "/apis/crd.projectcalico.org/v1/ippools";
const HANDLES: &str = "/apis/crd.projectcalico.org/v1/ipamhandles";
const AFFINITIES: &str = "/apis/crd.projectcalico.org/v1/blockaffinities";
const BLOCKS: &str = "/apis/crd.projectcalico.org/v1/ipamblocks";
const PODS: &str = "/api/v1/namespaces/default/pods";

const MERGE: &str = "application/merge-patch+json";
const STRATEGIC: &str = "application/strategic-merge-patch+json";
const JSON_PATCH: &str = "application/json-patch+json";

/// One curl exchange.
struct Answer {
    code: u16,
    /// curl's %{http_version}: "2" or "1.1".
    http: String,
    body: String,
    /// curl's exit code (28: timed out).
    exit: i32,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
}

/// Runs curl against `path` with `extra` arguments, the server's CA and (unless given in
/// `extra`) its token; gives up after `max_secs`.
fn curl_with(api: &KubeApi, path: &str, extra: &[&str], max_secs: u32) -> Answer {
    let mut cmd = Command::new("curl");
    cmd.args(["-sS", "--cacert"])
        .arg(api.ca_path())
        .args(["--max-time", &max_secs.to_string()])
        .args(["-w", "\n%{http_code} %{http_version}"]);
    if !extra.iter().any(|a| a.starts_with("Authorization")) {
        cmd.args(["-H", &format!("Authorization: Bearer {}", api.token())]);
    }
    let out = cmd
        .args(extra)
        .arg(format!("{}{path}", api.url()))
        .output()
        .expect("run curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, trailer) = text.rsplit_once('\n').unwrap_or(("", &text));
    let (code, http) = trailer.split_once(' ').unwrap_or((trailer, ""));
    Answer {
        code: code.parse().unwrap_or(0),
        http: http.to_string(),
        body: body.to_string(),
        exit: out.status.code().unwrap_or(-1),
    }
}

/// `method path` with an optional JSON body of `content_type`.
fn call(
    api: &KubeApi,
    method: &str,
    path: &str,
    content_type: &str,
    body: Option<&Value>,
) -> Answer {
    let text = body.map(Value::to_string);
    let ct = format!("Content-Type: {content_type}");
    let mut args = vec!["-X", method];
    if let Some(t) = &text {
        args.extend(["-H", &ct, "--data-binary", t]);
    }
    curl_with(api, path, &args, 5)
}

fn get(api: &KubeApi, path: &str) -> Answer {
    call(api, "GET", path, "", None)
}
fn post(api: &KubeApi, path: &str, body: Value) -> Answer {
    call(api, "POST", path, "application/json", Some(&body))
}
fn put(api: &KubeApi, path: &str, body: Value) -> Answer {
    call(api, "PUT", path, "application/json", Some(&body))
}
fn patch(api: &KubeApi, path: &str, content_type: &str, body: Value) -> Answer {
    call(api, "PATCH", path, content_type, Some(&body))
}

/// Asserts a Status failure with this code, reason and message.
fn assert_status(a: &Answer, code: u16, reason: &str, message: &str) {
    assert_eq!(a.code, code, "{}", a.body);
    let s = a.json();
    assert_eq!(s["kind"], "Status", "{s}");
    assert_eq!(s["apiVersion"], "v1", "{s}");
    assert_eq!(s["status"], "Failure", "{s}");
    assert_eq!(s["code"], code, "{s}");
    assert_eq!(s["reason"].as_str().unwrap_or(""), reason, "{s}");
    assert_eq!(s["message"], message, "{s}");
}

fn handle(name: &str) -> Value {
    json!({
        "apiVersion": "crd.projectcalico.org/v1", "kind": "IPAMHandle",
        "metadata": {"name": name},
        "spec": {"handleID": name, "block": {"10.0.0.0/26": 1}},
    })
}

fn rv(v: &Value) -> String {
    v["metadata"]["resourceVersion"]
        .as_str()
        .unwrap()
        .to_string()
}
fn uid(v: &Value) -> String {
    v["metadata"]["uid"].as_str().unwrap().to_string()
}

/// A namespace and a pod bound to node-1, seeded directly.
fn seed_pod(api: &KubeApi, name: &str) -> Value {
    api.put("/api/v1/namespaces/default", json!({"metadata": {}}));
    api.put(
        &format!("{PODS}/{name}"),
        json!({
            "metadata": {"labels": {"app": "web"}, "annotations": {"keep": "me"}},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "busybox"}]},
            "status": {"phase": "Running"},
        }),
    )
}

#[test]
fn a_wrong_or_missing_token_is_401() {
    let api = KubeApi::start();
    let unauthorized = r#"{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#;
    let wrong = curl_with(&api, POOLS, &["-H", "Authorization: Bearer nope"], 5);
    assert_eq!((wrong.code, wrong.body.as_str()), (401, unauthorized));
    let none = curl_with(&api, "/no/such/path", &["-H", "Authorization:"], 5);
    assert_eq!((none.code, none.body.as_str()), (401, unauthorized));
    assert_eq!(get(&api, POOLS).code, 200);
    let statuses: Vec<u16> = api.requests().iter().map(|r| r.status).collect();
    assert_eq!(statuses, [401, 401, 200]);
}

#[test]
fn create_get_and_the_real_error_texts() {
    let api = KubeApi::start();
    let created = post(&api, HANDLES, handle("h1"));
    assert_eq!(created.code, 201, "{}", created.body);
    let obj = created.json();
    let u = uid(&obj);
    assert!(u.len() == 36 && u.as_bytes()[14] == b'4', "a v4 UUID: {u}");
    assert_eq!(obj["metadata"]["generation"], 1);
    let ts = obj["metadata"]["creationTimestamp"].as_str().unwrap();
    assert!(
        ts.len() == 20 && ts.ends_with('Z') && ts.as_bytes()[10] == b'T',
        "{ts}"
    );
    assert_eq!(get(&api, &format!("{HANDLES}/h1")).json(), obj);
    assert_eq!(api.get(&format!("{HANDLES}/h1")), Some(obj.clone()));

    let again = post(&api, HANDLES, handle("h1"));
    assert_status(
        &again,
        409,
        "AlreadyExists",
        "ipamhandles.crd.projectcalico.org \"h1\" already exists",
    );
    assert_eq!(
        again.json()["details"],
        json!({"name": "h1", "group": "crd.projectcalico.org", "kind": "ipamhandles"})
    );
    let missing = get(&api, &format!("{HANDLES}/nope"));
    assert_status(
        &missing,
        404,
        "NotFound",
        "ipamhandles.crd.projectcalico.org \"nope\" not found",
    );
    for (path, msg) in [
        (format!("{PODS}/p"), "pods \"p\" not found"),
        (
            "/api/v1/namespaces/ns1".into(),
            "namespaces \"ns1\" not found",
        ),
        ("/api/v1/nodes/n1".into(), "nodes \"n1\" not found"),
    ] {
        assert_status(&get(&api, &path), 404, "NotFound", msg);
    }

    let bad = post(&api, HANDLES, handle("Bad_Name"));
    assert_status(&bad, 422, "Invalid", "IPAMHandle.crd.projectcalico.org \"Bad_Name\" is invalid: metadata.name: Invalid value: \"Bad_Name\": a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')");
    assert_eq!(bad.json()["details"]["causes"][0]["field"], "metadata.name");

    let mut generated = handle("");
    generated["metadata"] = json!({"generateName": "h-"});
    let g = post(&api, HANDLES, generated).json();
    let name = g["metadata"]["name"].as_str().unwrap();
    assert!(name.starts_with("h-") && name.len() == 7, "{name}");

    // The CRD schemas' required fields.
    let block = json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "IPAMBlock",
        "metadata": {"name": "10-0-0-0-26"}, "spec": {"cidr": "10.0.0.0/26"}});
    assert_status(&post(&api, BLOCKS, block), 422, "Invalid", "IPAMBlock.crd.projectcalico.org \"10-0-0-0-26\" is invalid: [spec.allocations: Required value, spec.attributes: Required value, spec.strictAffinity: Required value, spec.unallocated: Required value]");
    let mut h = handle("h2");
    h["spec"].as_object_mut().unwrap().remove("block");
    assert_status(
        &post(&api, HANDLES, h),
        422,
        "Invalid",
        "IPAMHandle.crd.projectcalico.org \"h2\" is invalid: spec.block: Required value",
    );
    let aff = json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "BlockAffinity",
        "metadata": {"name": "a1"}, "spec": {"cidr": "10.0.0.0/26", "node": "n", "state": "confirmed", "deleted": false}});
    assert_status(&post(&api, AFFINITIES, aff), 422, "Invalid", "BlockAffinity.crd.projectcalico.org \"a1\" is invalid: spec.deleted: Invalid value: \"boolean\": spec.deleted in body must be of type string: \"boolean\"");

    // Storage refuses a resourceVersion on create, as a reasonless 500.
    let mut with_rv = handle("h3");
    with_rv["metadata"]["resourceVersion"] = "12".into();
    assert_status(
        &post(&api, HANDLES, with_rv),
        500,
        "",
        "resourceVersion should not be set on objects to be created",
    );
    // A custom resource must say its kind.
    let mut no_kind = handle("h4");
    no_kind.as_object_mut().unwrap().remove("kind");
    assert_eq!(post(&api, HANDLES, no_kind).code, 400);

    // Pods: only into an existing namespace, and with containers.
    let pod =
        json!({"metadata": {"name": "p1"}, "spec": {"containers": [{"name": "c", "image": "i"}]}});
    assert_status(
        &post(&api, "/api/v1/namespaces/ns1/pods", pod.clone()),
        404,
        "NotFound",
        "namespaces \"ns1\" not found",
    );
    assert_eq!(
        post(
            &api,
            "/api/v1/namespaces",
            json!({"metadata": {"name": "ns1"}})
        )
        .code,
        201
    );
    let p = post(&api, "/api/v1/namespaces/ns1/pods", pod).json();
    assert_eq!(
        (p["kind"].as_str(), p["metadata"]["namespace"].as_str()),
        (Some("Pod"), Some("ns1"))
    );
    assert_eq!(p["status"]["phase"], "Pending");
}

#[test]
fn updates_are_compare_and_swap_on_resource_version() {
    let api = KubeApi::start();
    let v1 = post(&api, HANDLES, handle("h1")).json();
    let path = format!("{HANDLES}/h1");

    let mut next = v1.clone();
    next["spec"]["block"] = json!({"10.0.0.0/26": 2});
    let v2 = put(&api, &path, next.clone());
    assert_eq!(v2.code, 200, "{}", v2.body);
    let v2 = v2.json();
    assert_eq!(v2["spec"]["block"]["10.0.0.0/26"], 2);
    assert_eq!(
        (uid(&v2), &v2["metadata"]["creationTimestamp"]),
        (uid(&v1), &v1["metadata"]["creationTimestamp"])
    );
    assert!(rv(&v2).parse::<u64>().unwrap() > rv(&v1).parse::<u64>().unwrap());
    assert_eq!(v2["metadata"]["generation"], 2);

    // The same stale write again: a conflict.
    assert_status(&put(&api, &path, next.clone()), 409, "Conflict", "Operation cannot be fulfilled on ipamhandles.crd.projectcalico.org \"h1\": the object has been modified; please apply your changes to the latest version and try again");
    // Custom resources have no unconditional update.
    let mut unconditional = v2.clone();
    unconditional["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    assert_status(&put(&api, &path, unconditional), 422, "Invalid", "ipamhandles.crd.projectcalico.org \"h1\" is invalid: metadata.resourceVersion: Invalid value: 0: must be specified for an update");
    // A uid in the body is a precondition.
    let mut other_uid = v2.clone();
    other_uid["metadata"]["uid"] = "00000000-0000-4000-8000-000000000000".into();
    assert_status(&put(&api, &path, other_uid), 409, "Conflict", &format!("Operation cannot be fulfilled on ipamhandles.crd.projectcalico.org \"h1\": StorageError: invalid object, Code: 4, Key: /registry/crd.projectcalico.org/ipamhandles/h1, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: UID in precondition: 00000000-0000-4000-8000-000000000000, UID in object meta: {}", uid(&v1)));
    // A write that changes nothing keeps the resourceVersion.
    assert_eq!(rv(&put(&api, &path, v2.clone()).json()), rv(&v2));
    assert_status(
        &put(&api, &format!("{HANDLES}/h9"), handle("h9")),
        404,
        "NotFound",
        "ipamhandles.crd.projectcalico.org \"h9\" not found",
    );
    let renamed = put(&api, &path, handle("h2"));
    assert_status(
        &renamed,
        400,
        "BadRequest",
        "the name of the object (h2) does not match the name on the URL (h1)",
    );

    // Pods may be updated unconditionally; status is kept by the main resource.
    let pod = seed_pod(&api, "p1");
    let mut p = pod.clone();
    p["metadata"]
        .as_object_mut()
        .unwrap()
        .remove("resourceVersion");
    p["metadata"]["labels"]["app"] = "db".into();
    p["status"]["phase"] = "Failed".into();
    let updated = put(&api, &format!("{PODS}/p1"), p.clone()).json();
    assert_eq!(
        (
            updated["metadata"]["labels"]["app"].as_str(),
            updated["status"]["phase"].as_str()
        ),
        (Some("db"), Some("Running"))
    );
    p["spec"]["nodeName"] = "node-2".into();
    let forbidden = put(&api, &format!("{PODS}/p1"), p);
    assert_eq!(
        (
            forbidden.code,
            forbidden.json()["details"]["causes"][0]["reason"].as_str()
        ),
        (422, Some("FieldValueForbidden"))
    );
}

#[test]
fn delete_preconditions_and_graceful_pods() {
    let api = KubeApi::start();
    let obj = post(&api, HANDLES, handle("h1")).json();
    let path = format!("{HANDLES}/h1");
    let stale_uid = "00000000-0000-4000-8000-000000000000";
    let opts =
        json!({"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": stale_uid}});
    let refused = call(&api, "DELETE", &path, "application/json", Some(&opts));
    assert_status(&refused, 409, "Conflict", &format!("Operation cannot be fulfilled on IPAMHandle.crd.projectcalico.org \"h1\": the UID in the precondition ({stale_uid}) does not match the UID in record ({}). The object might have been deleted and then recreated", uid(&obj)));
    assert_eq!(refused.json()["details"]["kind"], "IPAMHandle");
    let opts = json!({"preconditions": {"resourceVersion": "999"}});
    let refused = call(&api, "DELETE", &path, "application/json", Some(&opts));
    assert_status(&refused, 409, "Conflict", &format!("Operation cannot be fulfilled on IPAMHandle.crd.projectcalico.org \"h1\": the ResourceVersion in the precondition (999) does not match the ResourceVersion in record ({}). The object might have been modified", rv(&obj)));

    let opts = json!({"preconditions": {"uid": uid(&obj), "resourceVersion": rv(&obj)}});
    let deleted = call(&api, "DELETE", &path, "application/json", Some(&opts));
    assert_eq!((deleted.code, deleted.json()), (200, obj));
    assert_eq!(call(&api, "DELETE", &path, "", None).code, 404);
    assert_eq!(api.get(&path), None);

    // A pod on a node only gets a deletionTimestamp, until deleted with grace 0.
    seed_pod(&api, "p1");
    let p = format!("{PODS}/p1");
    let terminating = call(&api, "DELETE", &p, "", None).json();
    assert_eq!(terminating["metadata"]["deletionGracePeriodSeconds"], 30);
    assert!(api.get(&p).unwrap()["metadata"]["deletionTimestamp"].is_string());
    let gone = call(
        &api,
        "DELETE",
        &p,
        "application/json",
        Some(&json!({"gracePeriodSeconds": 0})),
    );
    assert_eq!(
        (gone.code, gone.json()["kind"].as_str()),
        (200, Some("Pod"))
    );
    assert_eq!(api.get(&p), None);
}

#[test]
fn patches_on_pod_status_and_custom_resources() {
    let api = KubeApi::start();
    let pod = seed_pod(&api, "p1");
    let status = format!("{PODS}/p1/status");

    // A merge patch with the current resourceVersion as precondition.
    let body = json!({"metadata": {"resourceVersion": rv(&pod), "annotations": {"cni.projectcalico.org/podIP": "10.0.0.1/32"}},
        "status": {"podIP": "10.0.0.1"}, "spec": {"nodeName": "elsewhere"}});
    let patched = patch(&api, &status, MERGE, body.clone());
    assert_eq!(patched.code, 200, "{}", patched.body);
    let patched = patched.json();
    assert_eq!(
        patched["metadata"]["annotations"],
        json!({"keep": "me", "cni.projectcalico.org/podIP": "10.0.0.1/32"})
    );
    assert_eq!(
        (
            patched["status"]["podIP"].as_str(),
            patched["status"]["phase"].as_str()
        ),
        (Some("10.0.0.1"), Some("Running"))
    );
    assert_eq!(
        patched["spec"], pod["spec"],
        "the status subresource ignores spec"
    );
    assert_eq!(get(&api, &status).json(), patched);
    // The same precondition is stale now.
    assert_status(&patch(&api, &status, MERGE, body), 409, "Conflict", "Operation cannot be fulfilled on pods \"p1\": the object has been modified; please apply your changes to the latest version and try again");

    // Strategic merge: null deletes, lists are replaced; precondition honoured.
    let body = json!({"metadata": {"resourceVersion": rv(&patched), "annotations": {"keep": null}},
        "status": {"podIPs": [{"ip": "10.0.0.1"}]}});
    let s = patch(&api, &status, STRATEGIC, body).json();
    assert_eq!(
        s["metadata"]["annotations"],
        json!({"cni.projectcalico.org/podIP": "10.0.0.1/32"})
    );
    assert_eq!(s["status"]["podIPs"], json!([{"ip": "10.0.0.1"}]));
    assert_eq!(
        patch(
            &api,
            &status,
            STRATEGIC,
            json!({"metadata": {"resourceVersion": "1"}})
        )
        .code,
        409
    );
    assert_eq!(
        patch(
            &api,
            &status,
            STRATEGIC,
            json!({"status": {"$patch": "replace"}})
        )
        .code,
        400
    );

    // The main resource ignores status; a patched uid is an immutable field.
    let main = patch(
        &api,
        &format!("{PODS}/p1"),
        MERGE,
        json!({"status": {"phase": "Failed"}, "metadata": {"labels": {"x": "y"}}}),
    )
    .json();
    assert_eq!(
        (
            main["status"]["phase"].as_str(),
            main["metadata"]["labels"]["x"].as_str()
        ),
        (Some("Running"), Some("y"))
    );
    let wrong_uid = patch(&api, &status, MERGE, json!({"metadata": {"uid": "u-1"}}));
    assert_status(
        &wrong_uid,
        422,
        "Invalid",
        "Pod \"p1\" is invalid: metadata.uid: Invalid value: \"u-1\": field is immutable",
    );

    // Custom resources: no strategic merge; JSON patch; merge patch dropping the
    // resourceVersion is an unconditional update they refuse.
    let h = post(&api, HANDLES, handle("h1")).json();
    let path = format!("{HANDLES}/h1");
    let sm = patch(&api, &path, STRATEGIC, json!({"spec": {}}));
    assert_status(&sm, 415, "UnsupportedMediaType", "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml");
    let ops = json!([{"op": "test", "path": "/metadata/resourceVersion", "value": rv(&h)},
        {"op": "replace", "path": "/spec/block/10.0.0.0~126", "value": 5}, {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]);
    let jp = patch(&api, &path, JSON_PATCH, ops.clone()).json();
    assert_eq!(
        (
            jp["spec"]["block"]["10.0.0.0/26"].as_i64(),
            jp["metadata"]["labels"]["a"].as_str()
        ),
        (Some(5), Some("b"))
    );
    assert_eq!(jp["metadata"]["generation"], 2);
    assert_status(
        &patch(&api, &path, JSON_PATCH, ops),
        422,
        "Invalid",
        "the server rejected our request due to an error in our request",
    );
    assert_eq!(
        patch(
            &api,
            &path,
            MERGE,
            json!({"metadata": {"resourceVersion": null}})
        )
        .code,
        422
    );
    assert_eq!(patch(&api, &path, "text/plain", json!({})).code, 415);
    assert_eq!(
        patch(&api, &format!("{HANDLES}/nope"), MERGE, json!({})).code,
        404
    );
}

#[test]
fn lists_and_selectors() {
    let api = KubeApi::start();
    let labels = [
        ("b", json!({"tier": "web", "zone": "a"})),
        ("a", json!({"tier": "db", "zone": "b", "n": "5"})),
        ("c", json!({"tier": "cache"})),
        ("d", json!(null)),
    ];
    for (name, l) in &labels {
        let mut pool = json!({"apiVersion": "crd.projectcalico.org/v1", "kind": "IPPool",
            "metadata": {"name": name}, "spec": {"cidr": "10.0.0.0/16"}});
        if !l.is_null() {
            pool["metadata"]["labels"] = l.clone();
        }
        assert_eq!(post(&api, POOLS, pool).code, 201);
    }
    let names = |selector: &str| -> Vec<String> {
        let q = selector
            .replace(" ", "%20")
            .replace("!", "%21")
            .replace("=", "%3D")
            .replace(">", "%3E");
        let list = get(&api, &format!("{POOLS}?labelSelector={q}"));
        assert_eq!(list.code, 200, "{selector}: {}", list.body);
        let items = list.json()["items"].as_array().unwrap().clone();
        items
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(names(""), ["a", "b", "c", "d"]);
    assert_eq!(names("tier=web"), ["b"]);
    assert_eq!(names("tier==db"), ["a"]);
    assert_eq!(names("tier!=web"), ["a", "c", "d"]);
    assert_eq!(names("zone"), ["a", "b"]);
    assert_eq!(names("!zone"), ["c", "d"]);
    assert_eq!(names("tier in (web, cache)"), ["b", "c"]);
    assert_eq!(names("tier notin (web,cache)"), ["a", "d"]);
    assert_eq!(names("tier in (web,db),zone=b"), ["a"]);
    assert_eq!(names("n>4"), ["a"]);
    assert_eq!(
        get(&api, &format!("{POOLS}?labelSelector=tier%20in%20web")).code,
        400
    );

    let list = get(&api, POOLS).json();
    assert_eq!(
        (list["kind"].as_str(), list["apiVersion"].as_str()),
        (Some("IPPoolList"), Some("crd.projectcalico.org/v1"))
    );
    assert!(list["metadata"]["resourceVersion"].is_string());
    assert_eq!(
        list["items"][0]["kind"], "IPPool",
        "custom resource items carry their kind"
    );

    // Pages.
    let page = get(&api, &format!("{POOLS}?limit=3")).json();
    assert_eq!(
        (
            page["items"].as_array().unwrap().len(),
            page["metadata"]["remainingItemCount"].as_u64()
        ),
        (3, Some(1))
    );
    let token = page["metadata"]["continue"].as_str().unwrap();
    let rest = get(&api, &format!("{POOLS}?limit=3&continue={token}")).json();
    assert_eq!(rest["items"][0]["metadata"]["name"], "d");
    assert!(rest["metadata"].get("continue").is_none());

    // Pods: per namespace or across all; field selectors; built-in items have no kind.
    seed_pod(&api, "p1");
    api.put("/api/v1/namespaces/other", json!({}));
    api.put(
        "/api/v1/namespaces/other/pods/p2",
        json!({"spec": {"nodeName": "node-2"}}),
    );
    let pods = get(&api, PODS).json();
    assert_eq!(
        (
            pods["kind"].as_str(),
            pods["items"].as_array().unwrap().len()
        ),
        (Some("PodList"), 1)
    );
    assert!(pods["items"][0].get("kind").is_none());
    let all = get(&api, "/api/v1/pods?fieldSelector=spec.nodeName%3Dnode-2").json();
    assert_eq!(all["items"][0]["metadata"]["name"], "p2");
    let bad = get(&api, "/api/v1/pods?fieldSelector=spec.bogus%3Dx");
    assert_status(
        &bad,
        400,
        "BadRequest",
        "field label not supported: spec.bogus",
    );
    assert_eq!(api.list("/api/v1/pods").len(), 2);
}

#[test]
fn h2_and_http1_are_both_negotiated_and_recorded() {
    let api = KubeApi::start();
    let h2 = curl_with(&api, POOLS, &["--http2"], 5);
    let h1 = curl_with(&api, POOLS, &["--http1.1"], 5);
    assert_eq!((h2.code, h2.http.as_str()), (200, "2"));
    assert_eq!((h1.code, h1.http.as_str()), (200, "1.1"));
    assert_eq!(api.handshakes(), 2);
    assert_eq!(api.protocols(), ["h2", "http/1.1"]);
    let seen: Vec<(String, usize)> = api
        .requests()
        .into_iter()
        .map(|r| (r.version, r.connection))
        .collect();
    assert_eq!(
        seen,
        [("HTTP/2.0".to_string(), 1), ("HTTP/1.1".to_string(), 2)]
    );
    api.clear_requests();
    assert!(api.requests().is_empty());
}

#[test]
fn a_stalled_server_times_clients_out_and_still_stops() {
    let api = KubeApi::start();
    api.set_stall(true);
    let start = Instant::now();
    let stalled = curl_with(&api, POOLS, &[], 1);
    assert_eq!(stalled.exit, 28, "curl timed out");
    assert!(start.elapsed() < Duration::from_secs(3));
    let r = api.requests();
    assert_eq!((r.len(), r[0].status), (1, 0), "read, never answered");
    api.set_stall(false);
    assert_eq!(get(&api, POOLS).code, 200);
    // Stall again and leave a request hanging: dropping the server must not wait on it.
    api.set_stall(true);
    let url = api.url();
    let hanging = std::thread::spawn(move || {
        Command::new("curl")
            .args(["-sk", "--max-time", "5", &format!("{url}{POOLS}")])
            .output()
    });
    // curl's request reached the server (its third), which holds it unanswered.
    let until = Instant::now() + Duration::from_secs(10);
    while api.requests().len() < 3 {
        assert!(
            Instant::now() < until,
            "the hanging request never reached the server: {:?}",
            api.requests()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let start = Instant::now();
    drop(api);
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "drop took {:?}",
        start.elapsed()
    );
    hanging.join().unwrap().unwrap();
}

#[test]
fn fail_next_answers_canned_failures() {
    let api = KubeApi::start();
    api.fail_next(2, 503);
    for _ in 0..2 {
        assert_status(
            &get(&api, POOLS),
            503,
            "ServiceUnavailable",
            "the server is currently unable to handle the request",
        );
    }
    assert_eq!(get(&api, POOLS).code, 200);
    api.fail_next(1, 429);
    let a = curl_with(&api, POOLS, &["-i"], 5);
    assert_eq!(a.code, 429);
    assert!(
        a.body.to_ascii_lowercase().contains("retry-after: 1"),
        "{}",
        a.body
    );
    api.fail_next(1, 500);
    assert_eq!(get(&api, POOLS).json()["reason"], "InternalError");
    let codes: Vec<u16> = api.requests().iter().map(|r| r.status).collect();
    assert_eq!(codes, [503, 503, 200, 429, 500]);
}

#[test]
fn fail_one_fails_one_chosen_request() {
    let api = KubeApi::start();
    let pool = format!("{POOLS}/p1");
    api.put(
        &pool,
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool","metadata":{"name":"p1"},"spec":{"cidr":"10.0.0.0/24"}}),
    );
    // The second GET of that very path fails; other paths and methods are not counted.
    api.fail_one("GET", &pool, 1, 500);
    assert_eq!(get(&api, POOLS).code, 200);
    assert_eq!(get(&api, &pool).code, 200);
    assert_eq!(api.fail_one_pending(), 1);
    assert_eq!(get(&api, &pool).json()["reason"], "InternalError");
    assert_eq!(api.fail_one_pending(), 0);
    assert_eq!(get(&api, &pool).code, 200);
}

#[test]
fn unserved_paths_and_methods() {
    let api = KubeApi::start();
    for path in [
        "/apis/example.com/v1/widgets",
        "/api/v1/namespaces/default/nodes",
        "/apis/crd.projectcalico.org/v1/namespaces/default/ippools",
        "/api/v1/pods/p1",
        "/apis/crd.projectcalico.org/v1/ipamconfigurations",
    ] {
        let a = get(&api, path);
        assert_eq!(
            (a.code, a.body.as_str()),
            (404, "404 page not found\n"),
            "{path}"
        );
    }
    let a = call(&api, "PUT", POOLS, "application/json", Some(&json!({})));
    assert_status(
        &a,
        405,
        "MethodNotAllowed",
        "the server does not allow this method on the requested resource",
    );
    assert_eq!(get(&api, "/version").json()["major"], "1");
}

#[test]
fn another_calico_group_can_be_served() {
    let api = KubeApi::start_with_group("projectcalico.org/v3");
    let config = json!({"apiVersion": "projectcalico.org/v3", "kind": "IPAMConfiguration",
        "metadata": {"name": "default"}, "spec": {"strictAffinity": false}});
    let a = post(
        &api,
        "/apis/projectcalico.org/v3/ipamconfigurations",
        config,
    );
    assert_eq!(a.code, 201, "{}", a.body);
    assert_eq!(
        get(&api, "/apis/projectcalico.org/v3/ipamconfigs").code,
        404
    );
    assert_eq!(
        get(&api, "/apis/crd.projectcalico.org/v1/ipamconfigs").code,
        200
    );
}

#[test]
fn kubeconfig_files_and_direct_store_access() {
    let api = KubeApi::start();
    let text = std::fs::read_to_string(api.kubeconfig()).unwrap();
    assert!(text.contains(&format!("server: {}", api.url())), "{text}");
    assert!(text.contains(&format!("token: {}", api.token())), "{text}");
    assert!(text.contains("current-context: test"), "{text}");
    let data = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("certificate-authority-data: "))
        .unwrap();
    let decoded = Command::new("sh")
        .args(["-c", &format!("echo {data} | base64 -d")])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(decoded.stdout).unwrap(), api.ca_pem());
    assert_eq!(
        std::fs::read_to_string(api.ca_path()).unwrap(),
        api.ca_pem()
    );
    let insecure = std::fs::read_to_string(api.kubeconfig_with("wrong", true)).unwrap();
    assert!(
        insecure.contains("insecure-skip-tls-verify: true") && insecure.contains("token: wrong")
    );
    assert!(!insecure.contains("certificate-authority-data"));

    // put fills server fields and bumps the resourceVersion; remove deletes.
    let p = api.put(
        &format!("{POOLS}/p1"),
        json!({"spec": {"cidr": "10.0.0.0/16"}}),
    );
    assert_eq!(
        (p["kind"].as_str(), p["metadata"]["name"].as_str()),
        (Some("IPPool"), Some("p1"))
    );
    let again = api.put(&format!("{POOLS}/p1"), p.clone());
    assert_eq!(uid(&again), uid(&p));
    assert_ne!(rv(&again), rv(&p));
    assert_eq!(api.list(POOLS).len(), 1);
    api.remove(&format!("{POOLS}/p1"));
    assert!(api.list(POOLS).is_empty());
    assert!(api.requests().is_empty(), "direct access is not recorded");
}

/// The kubeconfig works for a real rustls client (kube-rs): CA data, token, insecure variant.
#[test]
fn kube_rs_uses_the_kubeconfig() {
    use k8s_openapi::api::core::v1::Pod;
    let api = KubeApi::start();
    seed_pod(&api, "p1");
    let pods = |kubeconfig| async move {
        let kc = kube::config::Kubeconfig::read_from(kubeconfig).unwrap();
        let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
            .await
            .unwrap();
        kube::Api::<Pod>::namespaced(kube::Client::try_from(cfg).unwrap(), "default")
    };
    let code = |e: kube::Error| match e {
        kube::Error::Api(s) => s.code,
        other => panic!("{other:?}"),
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let good = pods(api.kubeconfig()).await;
        let p = good.get("p1").await.unwrap();
        assert_eq!(p.spec.unwrap().node_name.as_deref(), Some("node-1"));
        assert_eq!(good.list(&Default::default()).await.unwrap().items.len(), 1);
        assert_eq!(code(good.get("nope").await.unwrap_err()), 404);
        let insecure = pods(api.kubeconfig_with("wrong", true)).await;
        assert_eq!(code(insecure.get("p1").await.unwrap_err()), 401);
    });
}

/// `start_in_netns`: the server listens on that netns's loopback, not the host's.
#[test]
fn a_server_started_in_a_netns_listens_on_its_loopback() {
    let ns = common::netns::Netns::new("kube-api");
    let api = KubeApi::start_in_netns(ns.path());
    let ca = api.ca_path().display().to_string();
    let auth = format!("Authorization: Bearer {}", api.token());
    let url = format!("{}{POOLS}", api.url());
    let args = [
        "-sS",
        "--max-time",
        "5",
        "--cacert",
        &ca,
        "-H",
        &auth,
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &url,
    ];
    let inside = ns.exec("curl", &args);
    assert_eq!(String::from_utf8_lossy(&inside.stdout), "200", "{inside:?}");
    let outside = curl_with(&api, POOLS, &[], 2);
    assert_eq!(outside.exit, 7, "connection refused on the host's loopback");
}

/// Not a test: `make bench` runs this to serve the Kubernetes-datastore benchmark. Starts the
/// server in the netns `BENCH_KUBE_API_NETNS`, seeds a cluster (ClusterInformation ready,
/// Node `bench-node`, a /16 pool, namespace `default`, pods `pod-0`..`pod-<BENCH_PODS>`),
/// writes its kubeconfig to `$BENCH_KUBE_API_DIR/kubeconfig`, then serves until the file
/// `$BENCH_KUBE_API_DIR/stop` appears, and writes the request log to `requests.json`.
#[test]
#[ignore = "benchmark helper, run by benches/bench.py"]
fn serve_for_bench() {
    let netns = std::env::var("BENCH_KUBE_API_NETNS").expect("BENCH_KUBE_API_NETNS");
    let dir =
        std::path::PathBuf::from(std::env::var("BENCH_KUBE_API_DIR").expect("BENCH_KUBE_API_DIR"));
    let pods: usize = std::env::var("BENCH_PODS")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(100);
    let api = KubeApi::start_in_netns(&netns);
    let crd = "/apis/crd.projectcalico.org/v1";
    api.put(
        &format!("{crd}/clusterinformations/default"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"ClusterInformation","metadata":{"name":"default"},
            "spec":{"datastoreReady":true}}),
    );
    api.put(
        "/api/v1/nodes/bench-node",
        json!({"apiVersion":"v1","kind":"Node","metadata":{"name":"bench-node"},"spec":{}}),
    );
    api.put(
        &format!("{crd}/ippools/default-ipv4-ippool"),
        json!({"apiVersion":"crd.projectcalico.org/v1","kind":"IPPool","metadata":{"name":"default-ipv4-ippool"},
            "spec":{"cidr":"10.244.0.0/16","blockSize":26,"nodeSelector":"all()"}}),
    );
    api.put(
        "/api/v1/namespaces/default",
        json!({"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default"}}),
    );
    for i in 0..pods {
        api.put(
            &format!("/api/v1/namespaces/default/pods/pod-{i}"),
            json!({"apiVersion":"v1","kind":"Pod","metadata":{"name":format!("pod-{i}"),"namespace":"default"},
                "spec":{"nodeName":"bench-node","containers":[{"name":"c","image":"x"}]}}),
        );
    }
    std::fs::copy(api.kubeconfig(), dir.join("kubeconfig")).expect("write the kubeconfig");
    std::fs::write(dir.join("ready"), "").expect("write ready");
    while !dir.join("stop").exists() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let log: Vec<Value> = api
        .requests()
        .iter()
        .map(|r| json!({"method": r.method, "path": r.path, "connection": r.connection}))
        .collect();
    std::fs::write(
        dir.join("requests.json"),
        serde_json::to_string(&log).unwrap_or_default(),
    )
    .expect("write the request log");
    std::fs::write(dir.join("handshakes"), api.handshakes().to_string()).expect("write handshakes");
}
