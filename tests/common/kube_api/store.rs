//! The API server's REST semantics over an in-memory store: create / get / list / update /
//! patch / delete with the real server's preconditions, optimistic concurrency, strategies
//! (what an update may change) and error texts. Everything here is synchronous; the
//! transport in `mod.rs` calls [`State::handle`] with the lock held.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::list::parse_query;
use super::patch::{self, JsonPatchError};
use super::resource::{route, Resource, Target};
use super::status::{details, ApiError, FieldError, Reply};
use super::validate::{immutable_pod_spec, name_errors, schema_errors, POD_SPEC_FORBIDDEN};
use super::{new_uid, now_rfc3339, random_suffix, rfc3339};

fn meta(obj: &Value, field: &str) -> String {
    obj["metadata"][field]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj["metadata"].is_object() {
        obj["metadata"] = json!({});
    }
    obj["metadata"].as_object_mut().unwrap()
}

/// The media type of a Content-Type header, without parameters.
fn media_type(content_type: &str) -> &str {
    content_type.split(';').next().unwrap_or_default().trim()
}

/// The store and the resource-version counter.
pub struct State {
    pub(super) resources: Vec<Resource>,
    /// Objects per resource (`group/plural`), keyed `ns/name` or `name`.
    pub(super) objects: BTreeMap<String, BTreeMap<String, Value>>,
    /// The last resourceVersion handed out; every write takes the next one.
    pub(super) rv: u64,
}

impl State {
    pub fn new(resources: Vec<Resource>) -> State {
        State {
            resources,
            objects: BTreeMap::new(),
            rv: 0,
        }
    }

    fn bucket(&mut self, r: &Resource) -> &mut BTreeMap<String, Value> {
        self.objects
            .entry(format!("{}/{}", r.group, r.plural))
            .or_default()
    }

    fn lookup(&self, t: &Target) -> Option<&Value> {
        self.objects
            .get(&format!("{}/{}", t.res.group, t.res.plural))?
            .get(&t.key())
    }

    /// Stores `obj` at `t` with the next resourceVersion, and returns it.
    fn write(&mut self, t: &Target, mut obj: Value) -> Value {
        self.rv += 1;
        meta_mut(&mut obj).insert("resourceVersion".into(), self.rv.to_string().into());
        let key = t.key();
        self.bucket(&t.res).insert(key, obj.clone());
        obj
    }

    /// Sets what every stored object carries: kind, apiVersion, name, namespace.
    fn stamp(t: &Target, obj: &mut Value) {
        obj["kind"] = t.res.kind.clone().into();
        obj["apiVersion"] = t.res.api_version().into();
        let m = meta_mut(obj);
        m.insert("name".into(), t.name().into());
        if t.res.namespaced {
            m.insert("namespace".into(), t.ns().into());
        } else {
            m.remove("namespace");
        }
    }

    // ---- direct access for fixtures ----

    /// Creates or replaces the object at `path` without any check, filling server fields
    /// (uid and creationTimestamp unless given or already stored, a new resourceVersion).
    pub fn put(&mut self, path: &str, mut obj: Value) -> Value {
        let t = route(&self.resources, path)
            .filter(|t| t.name.is_some())
            .unwrap_or_else(|| {
                panic!("kube_api::put: {path} is not an object path this server serves")
            });
        let old = self.lookup(&t).cloned();
        Self::stamp(&t, &mut obj);
        let m = meta_mut(&mut obj);
        for (field, fresh) in [("uid", new_uid()), ("creationTimestamp", now_rfc3339())] {
            if m.get(field)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .is_empty()
            {
                let kept = old
                    .as_ref()
                    .map(|o| meta(o, field))
                    .filter(|v| !v.is_empty());
                m.insert(field.into(), kept.unwrap_or(fresh).into());
            }
        }
        if t.res.custom && !m.contains_key("generation") {
            m.insert("generation".into(), 1.into());
        }
        self.write(&t, obj)
    }

    pub fn get(&self, path: &str) -> Option<Value> {
        let t = route(&self.resources, path).filter(|t| t.name.is_some())?;
        self.lookup(&t).cloned()
    }

    /// The stored objects of a collection path, in key order (with kind and apiVersion).
    pub fn list(&self, path: &str) -> Vec<Value> {
        let Some(t) = route(&self.resources, path).filter(|t| t.name.is_none()) else {
            panic!("kube_api::list: {path} is not a collection path this server serves")
        };
        self.select(&t).map(|(_, v)| v.clone()).collect()
    }

    pub fn remove(&mut self, path: &str) {
        if let Some(t) = route(&self.resources, path).filter(|t| t.name.is_some()) {
            self.bucket(&t.res).remove(&t.key());
        }
    }

    // ---- the REST API ----

    /// Answers one authenticated request.
    pub fn handle(
        &mut self,
        method: &str,
        path: &str,
        query: &str,
        content_type: &str,
        body: &[u8],
    ) -> Reply {
        if path == "/version" && method == "GET" {
            let v = json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"});
            return Reply::json(200, &v);
        }
        let Some(t) = route(&self.resources, path) else {
            return Reply::page_not_found();
        };
        let q = parse_query(query);
        let result = match (method, t.name.is_some()) {
            ("GET", false) => self.list_request(&t, &q).map(|v| (200, v)),
            // A list across namespaces has no create.
            ("POST", false) if t.ns.is_some() || !t.res.namespaced => {
                self.create(&t, content_type, body)
            }
            ("GET", true) => self
                .lookup(&t)
                .cloned()
                .map(|v| (200, v))
                .ok_or_else(|| ApiError::not_found(&t.res, t.name())),
            ("PUT", true) => self.replace(&t, content_type, body),
            ("PATCH", true) => self.patch(&t, content_type, body),
            ("DELETE", true) if !t.status => self.delete(&t, &q, body),
            _ => Err(ApiError::method_not_allowed()),
        };
        match result {
            Ok((code, v)) => Reply::json(code, &v),
            Err(e) => e.reply(),
        }
    }

    /// Decodes a POST/PUT body: JSON (also accepted as YAML), kind/apiVersion checked.
    fn decode(t: &Target, content_type: &str, body: &[u8]) -> Result<Value, ApiError> {
        let accepted: &[&str] = if t.res.custom {
            &["application/json", "application/yaml"]
        } else {
            &[
                "application/json",
                "application/yaml",
                "application/vnd.kubernetes.protobuf",
            ]
        };
        // No Content-Type means JSON to the real server.
        let mt = media_type(content_type);
        if !["", "application/json", "application/yaml"].contains(&mt) {
            return Err(ApiError::unsupported_media_type(accepted));
        }
        let obj: Value = serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("the request body is not valid JSON: {e}"))
        })?;
        if !obj.is_object() {
            return Err(ApiError::bad_request(
                "the request body is not a JSON object",
            ));
        }
        let (kind, api_version) = (obj["kind"].as_str(), obj["apiVersion"].as_str());
        let (want_kind, want_version) = (&t.res.kind, t.res.api_version());
        if t.res.custom && kind.is_none() {
            let text = String::from_utf8_lossy(body);
            return Err(ApiError::bad_request(format!(
                "Object 'Kind' is missing in '{text}'"
            )));
        }
        // Built-in kinds default a missing apiVersion from the path.
        if api_version.is_some_and(|v| v != want_version) || (t.res.custom && api_version.is_none())
        {
            return Err(ApiError::bad_request(format!(
                "the API version in the data ({}) does not match the expected API version ({want_version})",
                api_version.unwrap_or_default()
            )));
        }
        match kind {
            Some(k) if k != want_kind && t.res.custom => {
                let e =
                    FieldError::invalid("kind", format!("{k:?}"), &format!("must be {want_kind}"));
                Err(ApiError::invalid(
                    &t.res.group,
                    want_kind,
                    &meta(&obj, "name"),
                    &[e],
                ))
            }
            Some(k) if k != want_kind => Err(ApiError::bad_request(format!(
                "the kind in the data ({k}) does not match the expected kind ({want_kind})"
            ))),
            _ => Ok(obj),
        }
    }

    fn create(
        &mut self,
        t: &Target,
        content_type: &str,
        body: &[u8],
    ) -> Result<(u16, Value), ApiError> {
        let mut obj = Self::decode(t, content_type, body)?;
        let r = &t.res;
        if r.namespaced {
            let body_ns = meta(&obj, "namespace");
            if !body_ns.is_empty() && body_ns != t.ns() {
                return Err(ApiError::bad_request(
                    "the namespace of the provided object does not match the namespace sent on the request",
                ));
            }
            // The NamespaceLifecycle admission plugin.
            let ns_target =
                route(&self.resources, &format!("/api/v1/namespaces/{}", t.ns())).unwrap();
            if self.lookup(&ns_target).is_none() {
                return Err(ApiError::not_found(&ns_target.res, t.ns()));
            }
        }
        let mut name = meta(&obj, "name");
        let generate = meta(&obj, "generateName");
        if name.is_empty() && !generate.is_empty() {
            let base: String = generate.chars().take(58).collect();
            name = format!("{base}{}", random_suffix());
        }
        let mut errs = if name.is_empty() {
            vec![FieldError::required(
                "metadata.name",
                "name or generateName is required",
            )]
        } else {
            name_errors(r, &name)
        };
        errs.extend(schema_errors(r, &obj));
        if !r.custom
            && r.plural == "pods"
            && obj["spec"]["containers"]
                .as_array()
                .is_none_or(Vec::is_empty)
        {
            errs.push(FieldError::required("spec.containers", ""));
        }
        if !errs.is_empty() {
            return Err(ApiError::invalid(&r.group, &r.kind, &name, &errs));
        }
        // Storage refuses a create that carries a resourceVersion (a non-zero number) with a
        // plain error, which the server answers as a 500 without a reason.
        if meta(&obj, "resourceVersion")
            .parse::<u64>()
            .is_ok_and(|v| v != 0)
        {
            return Err(ApiError::new(
                500,
                "",
                "resourceVersion should not be set on objects to be created",
            ));
        }
        let t = Target {
            name: Some(name.clone()),
            ..t.clone()
        };
        if self.lookup(&t).is_some() {
            return Err(ApiError::already_exists(r, &name));
        }
        Self::stamp(&t, &mut obj);
        let m = meta_mut(&mut obj);
        m.insert("uid".into(), new_uid().into());
        m.insert("creationTimestamp".into(), now_rfc3339().into());
        for f in [
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
        ] {
            m.remove(f);
        }
        if r.custom {
            m.insert("generation".into(), 1.into());
        }
        match (r.custom, r.plural.as_str()) {
            (false, "pods") => {
                obj["status"] = json!({"phase": "Pending"});
            }
            (false, "namespaces") => {
                let labels = meta_mut(&mut obj).entry("labels").or_insert(json!({}));
                labels["kubernetes.io/metadata.name"] = name.clone().into();
                obj["spec"] = json!({"finalizers": ["kubernetes"]});
                obj["status"] = json!({"phase": "Active"});
            }
            _ => {}
        }
        Ok((201, self.write(&t, obj)))
    }

    /// The existing object, or NotFound.
    fn existing(&self, t: &Target) -> Result<Value, ApiError> {
        self.lookup(t)
            .cloned()
            .ok_or_else(|| ApiError::not_found(&t.res, t.name()))
    }

    /// The name/namespace in a PUT body or patch result must be the URL's.
    fn check_name(t: &Target, obj: &Value) -> Result<(), ApiError> {
        let (name, ns) = (meta(obj, "name"), meta(obj, "namespace"));
        if name != t.name() {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({name}) does not match the name on the URL ({})",
                t.name()
            )));
        }
        if t.res.namespaced && !ns.is_empty() && ns != t.ns() {
            return Err(ApiError::bad_request(format!(
                "the namespace of the object ({ns}) does not match the namespace on the request ({})",
                t.ns()
            )));
        }
        Ok(())
    }

    fn replace(
        &mut self,
        t: &Target,
        content_type: &str,
        body: &[u8],
    ) -> Result<(u16, Value), ApiError> {
        let obj = Self::decode(t, content_type, body)?;
        Self::check_name(t, &obj)?;
        let existing = self.existing(t)?;
        // A uid in the body is a storage precondition.
        let uid = meta(&obj, "uid");
        if !uid.is_empty() && uid != meta(&existing, "uid") {
            let cause = format!(
                "StorageError: invalid object, Code: 4, Key: {}, ResourceVersion: 0, AdditionalErrorMsg: Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                t.res.etcd_key(t.ns(), t.name()),
                meta(&existing, "uid")
            );
            return Err(ApiError::conflict(
                &t.res.group,
                &t.res.plural,
                t.name(),
                &cause,
            ));
        }
        self.update(t, existing, obj)
    }

    fn patch(
        &mut self,
        t: &Target,
        content_type: &str,
        body: &[u8],
    ) -> Result<(u16, Value), ApiError> {
        let mut accepted = vec![
            "application/json-patch+json",
            "application/merge-patch+json",
        ];
        if !t.res.custom {
            accepted.push("application/strategic-merge-patch+json");
        }
        accepted.push("application/apply-patch+yaml");
        let mt = media_type(content_type);
        if !accepted.contains(&mt) {
            return Err(ApiError::unsupported_media_type(&accepted));
        }
        if mt == "application/apply-patch+yaml" {
            return Err(ApiError::new(
                415,
                "UnsupportedMediaType",
                "server-side apply is not implemented by the test API server",
            ));
        }
        let p: Value = serde_json::from_slice(body)
            .map_err(|e| ApiError::bad_request(format!("the patch is not valid JSON: {e}")))?;
        let existing = self.existing(t)?;
        let patched = match mt {
            "application/json-patch+json" => match patch::json_patch(&existing, &p) {
                Ok(v) => v,
                Err(JsonPatchError::Malformed(m)) => return Err(ApiError::bad_request(m)),
                // The real server drops the reason and answers a generic 422.
                Err(JsonPatchError::Failed(_)) => {
                    let msg = "the server rejected our request due to an error in our request";
                    return Err(ApiError::new(422, "Invalid", msg).with(json!({})));
                }
            },
            _ => {
                if mt.starts_with("application/strategic") {
                    if let Some(d) = patch::strategic_directive(&p) {
                        let msg = format!("strategic merge patch directive {d} is not implemented by the test API server");
                        return Err(ApiError::bad_request(msg));
                    }
                }
                let mut v = existing.clone();
                patch::merge(&mut v, &p);
                v
            }
        };
        if !patched.is_object() {
            return Err(ApiError::bad_request(
                "the patched object is not a JSON object",
            ));
        }
        Self::check_name(t, &patched)?;
        // A patch's uid is not a precondition but an (immutable) field: checked in update.
        self.update(t, existing, patched)
    }

    /// The update path PUT and PATCH share: `new` is what the client wants stored.
    fn update(&mut self, t: &Target, old: Value, mut new: Value) -> Result<(u16, Value), ApiError> {
        let r = &t.res;
        let name = t.name();
        // Optimistic concurrency on metadata.resourceVersion; none means "unconditional",
        // which custom resources do not allow.
        let rv = meta(&new, "resourceVersion");
        let parsed = if rv.is_empty() {
            Ok(0)
        } else {
            rv.parse::<u64>()
        };
        match parsed {
            Ok(0) => {
                if r.custom {
                    let e = FieldError::invalid(
                        "metadata.resourceVersion",
                        "0".into(),
                        "must be specified for an update",
                    );
                    return Err(ApiError::invalid(&r.group, &r.plural, name, &[e]));
                }
            }
            Ok(n) if n.to_string() == meta(&old, "resourceVersion") => {}
            Ok(_) => return Err(ApiError::modified(r, name)),
            Err(e) => {
                let e = FieldError::invalid(
                    "resourceVersion",
                    format!("{rv:?}"),
                    &format!("strconv.ParseUint: parsing {rv:?}: {e}"),
                );
                return Err(ApiError::invalid(&r.group, &r.plural, name, &[e]));
            }
        }
        // The update strategies: the main resource cannot change status, the status
        // subresource cannot change spec (nor a pod's ownerReferences).
        if r.has_status() {
            let keep = if t.status { "spec" } else { "status" };
            match old.get(keep) {
                Some(v) => new[keep] = v.clone(),
                None => {
                    new.as_object_mut().unwrap().remove(keep);
                }
            }
            if t.status && r.plural == "pods" {
                match old["metadata"].get("ownerReferences") {
                    Some(o) => meta_mut(&mut new).insert("ownerReferences".into(), o.clone()),
                    None => meta_mut(&mut new).remove("ownerReferences"),
                };
            }
        }
        Self::stamp(t, &mut new);
        let mut errs = vec![];
        let uid = meta(&new, "uid");
        if !uid.is_empty() && uid != meta(&old, "uid") {
            errs.push(FieldError::invalid(
                "metadata.uid",
                format!("{uid:?}"),
                "field is immutable",
            ));
        }
        // Server-owned metadata survives any update.
        let m = meta_mut(&mut new);
        for f in [
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "generation",
        ] {
            match old["metadata"].get(f) {
                Some(v) => m.insert(f.into(), v.clone()),
                None => m.remove(f),
            };
        }
        m.insert(
            "resourceVersion".into(),
            meta(&old, "resourceVersion").into(),
        );
        if r.custom {
            // Any change outside metadata is a new generation.
            let content = |o: &Value| -> BTreeMap<String, Value> {
                let m = o.as_object().unwrap();
                m.iter()
                    .filter(|(k, _)| *k != "metadata")
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            };
            if content(&new) != content(&old) {
                let g = old["metadata"]["generation"].as_i64().unwrap_or(1);
                meta_mut(&mut new).insert("generation".into(), (g + 1).into());
            }
        }
        errs.extend(schema_errors(r, &new));
        if !r.custom
            && r.plural == "pods"
            && !t.status
            && immutable_pod_spec(&new["spec"]) != immutable_pod_spec(&old["spec"])
        {
            errs.push(FieldError::forbidden("spec", POD_SPEC_FORBIDDEN));
        }
        if !errs.is_empty() {
            return Err(ApiError::invalid(&r.group, &r.kind, name, &errs));
        }
        // Storage skips a write that changes nothing: no new resourceVersion.
        if new == old {
            return Ok((200, old));
        }
        Ok((200, self.write(t, new)))
    }

    fn delete(
        &mut self,
        t: &Target,
        q: &BTreeMap<String, String>,
        body: &[u8],
    ) -> Result<(u16, Value), ApiError> {
        let opts: Value = if body.iter().all(u8::is_ascii_whitespace) {
            json!({})
        } else {
            serde_json::from_slice(body).map_err(|e| {
                ApiError::bad_request(format!("the DeleteOptions body is not valid JSON: {e}"))
            })?
        };
        let mut obj = self.existing(t)?;
        let r = &t.res;
        // Preconditions are checked early by the registry, and their conflict names the
        // object by its kind, not its resource.
        let pre = &opts["preconditions"];
        if let Some(uid) = pre["uid"].as_str().filter(|u| *u != meta(&obj, "uid")) {
            let cause = format!(
                "the UID in the precondition ({uid}) does not match the UID in record ({}). The object might have been deleted and then recreated",
                meta(&obj, "uid")
            );
            return Err(ApiError::conflict(&r.group, &r.kind, t.name(), &cause));
        }
        if let Some(rv) = pre["resourceVersion"]
            .as_str()
            .filter(|v| *v != meta(&obj, "resourceVersion"))
        {
            let cause = format!(
                "the ResourceVersion in the precondition ({rv}) does not match the ResourceVersion in record ({}). The object might have been modified",
                meta(&obj, "resourceVersion")
            );
            return Err(ApiError::conflict(&r.group, &r.kind, t.name(), &cause));
        }
        // A pod bound to a node is deleted gracefully: it gets a deletionTimestamp and stays
        // (until the kubelet, absent here, removes it, or a delete with grace 0).
        if !r.custom && r.plural == "pods" {
            let query_grace = q
                .get("gracePeriodSeconds")
                .and_then(|g| g.parse::<i64>().ok());
            let default = obj["spec"]["terminationGracePeriodSeconds"]
                .as_i64()
                .unwrap_or(30);
            let mut grace = opts["gracePeriodSeconds"]
                .as_i64()
                .or(query_grace)
                .unwrap_or(default);
            let phase = obj["status"]["phase"].as_str().unwrap_or_default();
            if obj["spec"]["nodeName"]
                .as_str()
                .unwrap_or_default()
                .is_empty()
                || phase == "Succeeded"
                || phase == "Failed"
            {
                grace = 0;
            }
            if grace > 0 {
                if obj["metadata"].get("deletionTimestamp").is_some() {
                    return Ok((200, obj));
                }
                let when =
                    std::time::SystemTime::now() + std::time::Duration::from_secs(grace as u64);
                let m = meta_mut(&mut obj);
                m.insert("deletionTimestamp".into(), rfc3339(when).into());
                m.insert("deletionGracePeriodSeconds".into(), grace.into());
                return Ok((200, self.write(t, obj)));
            }
        }
        self.bucket(r).remove(&t.key());
        // Pods and custom resources answer with the deleted object; nodes with a Status.
        if !r.custom && r.plural == "nodes" {
            let mut d = details(t.name(), &r.group, &r.plural);
            d["uid"] = meta(&obj, "uid").into();
            return Ok((
                200,
                json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": d}),
            ));
        }
        Ok((200, obj))
    }
}
