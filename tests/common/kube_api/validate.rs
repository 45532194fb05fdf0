//! The validation the real server does that a Calico client can trip over: object names,
//! the required fields of Calico's CRD schemas, and pod spec immutability.

use serde_json::Value;

use super::resource::{Resource, CALICO_CRD_GROUP};
use super::status::FieldError;

const SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

/// RFC 1123 label: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    !b.is_empty()
        && alnum(&b[0])
        && alnum(&b[b.len() - 1])
        && b.iter().all(|c| alnum(c) || *c == b'-')
}

/// The errors of `metadata.name`: namespaces must be RFC 1123 labels, everything else here
/// RFC 1123 subdomains.
pub fn name_errors(r: &Resource, name: &str) -> Vec<FieldError> {
    let (max, ok, msg) = if !r.custom && r.plural == "namespaces" {
        (63, is_label(name), LABEL_MSG)
    } else {
        (253, name.split('.').all(is_label), SUBDOMAIN_MSG)
    };
    let value = format!("{name:?}");
    let mut errs = vec![];
    if name.len() > max {
        let detail = format!("must be no more than {max} characters");
        errs.push(FieldError::invalid("metadata.name", value.clone(), &detail));
    }
    if !ok {
        errs.push(FieldError::invalid("metadata.name", value, msg));
    }
    errs
}

/// The OpenAPI type name a JSON value has (as schema validation reports it).
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_f64() => "number",
        Value::Number(_) => "integer",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The parts of Calico's CRD schemas a buggy client trips over: required `spec` fields, and
/// BlockAffinity's `deleted` being a string. Nothing else of the schemas is checked (and
/// unknown fields are kept, where the real server prunes them).
pub fn schema_errors(r: &Resource, obj: &Value) -> Vec<FieldError> {
    if r.group != CALICO_CRD_GROUP {
        return vec![];
    }
    let required: &[&str] = match r.kind.as_str() {
        "IPAMBlock" => &[
            "allocations",
            "attributes",
            "cidr",
            "strictAffinity",
            "unallocated",
        ],
        "IPAMHandle" => &["block", "handleID"],
        "BlockAffinity" => &["cidr", "deleted", "node", "state"],
        _ => &[],
    };
    let Some(spec) = obj.get("spec").and_then(Value::as_object) else {
        return vec![];
    };
    let mut errs: Vec<FieldError> = required
        .iter()
        .filter(|f| !spec.contains_key(**f))
        .map(|f| FieldError::required(&format!("spec.{f}"), ""))
        .collect();
    if let Some(d) = spec
        .get("deleted")
        .filter(|d| r.kind == "BlockAffinity" && !d.is_string())
    {
        let t = type_name(d);
        let detail = format!("spec.deleted in body must be of type string: \"{t}\"");
        errs.push(FieldError::invalid(
            "spec.deleted",
            format!("\"{t}\""),
            &detail,
        ));
    }
    errs
}

/// A pod spec with the fields an update may change blanked out.
pub fn immutable_pod_spec(spec: &Value) -> Value {
    let mut s = spec.clone();
    if let Some(m) = s.as_object_mut() {
        for f in [
            "activeDeadlineSeconds",
            "tolerations",
            "terminationGracePeriodSeconds",
        ] {
            m.remove(f);
        }
        for list in ["containers", "initContainers"] {
            for c in m
                .get_mut(list)
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                c.as_object_mut().map(|c| c.remove("image"));
            }
        }
    }
    s
}

pub const POD_SPEC_FORBIDDEN: &str = "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)";
