//! Go's `encoding/json` type rules for Calico's NetConf (cni-plugin/pkg/types at v3.32.1).
//!
//! serde is more lenient than Go in places that matter (a struct accepts a JSON array, an
//! `any`-typed field accepts everything), and its error texts differ. Upstream decodes stdin
//! into `types.NetConf` and fails the call with the decoder's first type error, so we check
//! the JSON against the same shape first and report Go's text, e.g.
//! `json: cannot unmarshal array into Go struct field NetConf.kubernetes of type types.Kubernetes`.
//! Keys match case-insensitively (exact match first), `null` leaves a field alone, unknown
//! keys are ignored, and the first error in document order wins — as in Go.

use serde_json::{Map, Value};

/// A Go field type, as far as JSON decoding can tell them apart.
#[derive(Clone, Copy)]
enum GoType {
    /// A string; the name printed for it (`string`, `resources.BackingAPIGroup`).
    Str(&'static str),
    Int,
    Uint64,
    Bool,
    StrSlice,
    /// `map[string]any`: any object.
    AnyMap,
    /// A struct: its Go type name as printed (`types.Kubernetes`), the name used as the
    /// `Struct` of errors inside it (`Kubernetes`, or "" for an anonymous struct), its fields.
    Struct(&'static Schema),
    /// A slice of structs.
    StructSlice(&'static Schema, &'static str),
}

struct Schema {
    type_name: &'static str,
    struct_name: &'static str,
    fields: &'static [(&'static str, GoType)],
}

const STRING: GoType = GoType::Str("string");

static KUBERNETES: Schema = Schema {
    type_name: "types.Kubernetes",
    struct_name: "Kubernetes",
    fields: &[
        ("k8s_api_root", STRING),
        ("kubeconfig", STRING),
        ("node_name", STRING),
    ],
};

static POLICY: Schema = Schema {
    type_name: "types.Policy",
    struct_name: "Policy",
    fields: &[
        ("type", STRING),
        ("k8s_api_root", STRING),
        ("k8s_auth_token", STRING),
        ("k8s_client_certificate", STRING),
        ("k8s_client_key", STRING),
        ("k8s_certificate_authority", STRING),
    ],
};

static FEATURE_CONTROL: Schema = Schema {
    type_name: "types.FeatureControl",
    struct_name: "FeatureControl",
    fields: &[
        ("ip_addrs_no_ipam", GoType::Bool),
        ("floating_ips", GoType::Bool),
    ],
};

static CONTAINER_SETTINGS: Schema = Schema {
    type_name: "types.ContainerSettings",
    struct_name: "ContainerSettings",
    fields: &[("allow_ip_forwarding", GoType::Bool)],
};

static IPAM: Schema = Schema {
    type_name: "struct { Name string; Type string \"json:\\\"type\\\"\"; Subnet string \"json:\\\"subnet\\\"\"; AssignIpv4 *string \"json:\\\"assign_ipv4\\\"\"; AssignIpv6 *string \"json:\\\"assign_ipv6\\\"\"; IPv4Pools []string \"json:\\\"ipv4_pools,omitempty\\\"\"; IPv6Pools []string \"json:\\\"ipv6_pools,omitempty\\\"\" }",
    struct_name: "",
    fields: &[
        ("Name", STRING),
        ("type", STRING),
        ("subnet", STRING),
        ("assign_ipv4", STRING),
        ("assign_ipv6", STRING),
        ("ipv4_pools", GoType::StrSlice),
        ("ipv6_pools", GoType::StrSlice),
    ],
};

static MESOS_LABEL: Schema = Schema {
    type_name: "struct { Key string \"json:\\\"key\\\"\"; Value string \"json:\\\"value\\\"\" }",
    struct_name: "",
    fields: &[("key", STRING), ("value", STRING)],
};

static MESOS_LABELS: Schema = Schema {
    type_name: "struct { Labels []struct { Key string \"json:\\\"key\\\"\"; Value string \"json:\\\"value\\\"\" } \"json:\\\"labels,omitempty\\\"\" }",
    struct_name: "",
    fields: &[(
        "labels",
        GoType::StructSlice(
            &MESOS_LABEL,
            "[]struct { Key string \"json:\\\"key\\\"\"; Value string \"json:\\\"value\\\"\" }",
        ),
    )],
};

static NETWORK_INFO: Schema = Schema {
    type_name: "types.NetworkInfo",
    struct_name: "NetworkInfo",
    fields: &[("name", STRING), ("labels", GoType::Struct(&MESOS_LABELS))],
};

static MESOS: Schema = Schema {
    type_name: "types.Mesos",
    struct_name: "Mesos",
    fields: &[("network_info", GoType::Struct(&NETWORK_INFO))],
};

static ARGS: Schema = Schema {
    type_name: "types.Args",
    struct_name: "Args",
    fields: &[("org.apache.mesos", GoType::Struct(&MESOS))],
};

static RUNTIME_DNS: Schema = Schema {
    type_name: "types.RuntimeConfigDNS",
    struct_name: "RuntimeConfigDNS",
    fields: &[
        ("servers", GoType::StrSlice),
        ("domain", STRING),
        ("searches", GoType::StrSlice),
        ("options", GoType::StrSlice),
    ],
};

static RUNTIME_CONFIG: Schema = Schema {
    type_name: "types.RuntimeConfig",
    struct_name: "RuntimeConfig",
    fields: &[("DNS", GoType::Struct(&RUNTIME_DNS))],
};

static NETCONF: Schema = Schema {
    type_name: "types.NetConf",
    struct_name: "NetConf",
    fields: &[
        ("cniVersion", STRING),
        ("name", STRING),
        ("type", STRING),
        // `mode`, `vxlan_*` and `windows_*` are Go-only (no config::NetConf field; the
        // tests' GO_ONLY): checked as upstream's decoder checks them, read only by
        // upstream's VXLAN and Windows code.
        ("mode", STRING),
        ("vxlan_mac_prefix", STRING),
        ("vxlan_vni", GoType::Uint64),
        ("ipam", GoType::Struct(&IPAM)),
        ("qps", GoType::Int),
        ("burst", GoType::Int),
        ("args", GoType::Struct(&ARGS)),
        ("mtu", GoType::Int),
        ("num_queues", GoType::Int),
        ("nodename", STRING),
        ("nodename_file", STRING),
        ("ipam_lock_file", STRING),
        ("nodename_file_optional", GoType::Bool),
        ("datastore_type", STRING),
        ("etcd_endpoints", STRING),
        ("etcd_discovery_srv", STRING),
        ("log_level", STRING),
        ("log_file_path", STRING),
        ("log_file_max_size", GoType::Int),
        ("log_file_max_age", GoType::Int),
        ("log_file_max_count", GoType::Int),
        ("policy", GoType::Struct(&POLICY)),
        ("kubernetes", GoType::Struct(&KUBERNETES)),
        ("feature_control", GoType::Struct(&FEATURE_CONTROL)),
        ("etcd_scheme", STRING),
        ("etcd_key_file", STRING),
        ("etcd_cert_file", STRING),
        ("etcd_ca_cert_file", STRING),
        ("container_settings", GoType::Struct(&CONTAINER_SETTINGS)),
        ("include_default_routes", GoType::Bool),
        ("dataplane_options", GoType::AnyMap),
        ("windows_pod_deletion_timestamp_timeout", GoType::Int),
        ("windows_use_single_network", GoType::Bool),
        ("windows_disable_default_deny_all_policy", GoType::Bool),
        ("windows_loopback_DSR", GoType::Bool),
        ("RuntimeConfig", GoType::Struct(&RUNTIME_CONFIG)),
        ("readiness_gates", GoType::StrSlice),
        ("policy_setup_timeout_seconds", GoType::Int),
        // Ours (not upstream's): the call's deadline (`crate::support::deadline`).
        ("call_timeout_seconds", GoType::Int),
        ("endpoint_status_dir", STRING),
        ("etcd_authority", STRING),
        ("hostname", STRING),
        ("require_mtu_file", GoType::Bool),
        ("calico_api_group", GoType::Str("resources.BackingAPIGroup")),
    ],
};

/// Checks stdin's JSON against `types.NetConf` as Go's decoder would; `Err` is Go's text.
pub fn check_netconf(v: &Value) -> Result<(), String> {
    match v {
        Value::Object(obj) => check_struct(obj, &NETCONF, &mut Vec::new()),
        Value::Null => Ok(()),
        other => Err(format!(
            "json: cannot unmarshal {} into Go value of type types.NetConf",
            json_kind(other)
        )),
    }
}

/// Go's name for a JSON value in a type error.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The field an object key decodes into: an exact match, else the first case-insensitive one.
fn field_for<'s>(schema: &'s Schema, key: &str) -> Option<&'s (&'static str, GoType)> {
    schema
        .fields
        .iter()
        .find(|(name, _)| *name == key)
        .or_else(|| {
            schema
                .fields
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case(key))
        })
}

fn check_struct(
    obj: &Map<String, Value>,
    schema: &Schema,
    path: &mut Vec<&'static str>,
) -> Result<(), String> {
    for (key, value) in obj {
        let Some((name, ty)) = field_for(schema, key) else {
            continue;
        };
        path.push(name);
        let r = check_value(value, *ty, schema.struct_name, path);
        path.pop();
        r?;
    }
    Ok(())
}

fn type_error(value: &str, struct_name: &str, path: &[&str], go_type: &str) -> String {
    format!(
        "json: cannot unmarshal {value} into Go struct field {struct_name}.{} of type {go_type}",
        path.join(".")
    )
}

fn check_value(
    v: &Value,
    ty: GoType,
    struct_name: &str,
    path: &mut Vec<&'static str>,
) -> Result<(), String> {
    if v.is_null() {
        return Ok(());
    }
    let mismatch = |go_type: &str| Err(type_error(json_kind(v), struct_name, path, go_type));
    match ty {
        GoType::Str(name) => match v {
            Value::String(_) => Ok(()),
            _ => mismatch(name),
        },
        GoType::Bool => match v {
            Value::Bool(_) => Ok(()),
            _ => mismatch("bool"),
        },
        GoType::Int => check_integer(v, "int", true, struct_name, path),
        GoType::Uint64 => check_integer(v, "uint64", false, struct_name, path),
        GoType::StrSlice => match v {
            Value::Array(items) => {
                for item in items {
                    if !item.is_null() && !item.is_string() {
                        return Err(type_error(json_kind(item), struct_name, path, "string"));
                    }
                }
                Ok(())
            }
            _ => mismatch("[]string"),
        },
        GoType::AnyMap => match v {
            Value::Object(_) => Ok(()),
            _ => mismatch("map[string]interface {}"),
        },
        GoType::Struct(schema) => match v {
            Value::Object(obj) => check_struct(obj, schema, path),
            _ => mismatch(schema.type_name),
        },
        GoType::StructSlice(schema, slice_name) => match v {
            Value::Array(items) => {
                for item in items {
                    match item {
                        Value::Object(obj) => check_struct(obj, schema, path)?,
                        Value::Null => {}
                        other => {
                            return Err(type_error(
                                json_kind(other),
                                struct_name,
                                path,
                                schema.type_name,
                            ))
                        }
                    }
                }
                Ok(())
            }
            _ => mismatch(slice_name),
        },
    }
}

/// A Go integer field's value: Go refuses a fraction, an exponent or an out-of-range value.
fn check_integer(
    v: &Value,
    go_type: &str,
    signed: bool,
    struct_name: &str,
    path: &[&'static str],
) -> Result<(), String> {
    let Value::Number(n) = v else {
        return Err(type_error(json_kind(v), struct_name, path, go_type));
    };
    let literal = n.to_string();
    let fits = if signed { n.is_i64() } else { n.is_u64() };
    if fits && !literal.contains(['.', 'e', 'E']) {
        return Ok(());
    }
    Err(type_error(
        &format!("number {literal}"),
        struct_name,
        path,
        go_type,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::fields::{shape_of, Shape};
    use crate::config::NetConf;
    use serde_json::json;

    /// Fields of Go's struct that `NetConf` does not decode (type-checked here only).
    const GO_ONLY: &[&str] = &[
        // Used by upstream's VXLAN/Windows code paths, which this plugin does not have.
        "mode",
        "vxlan_mac_prefix",
        "vxlan_vni",
        "windows_pod_deletion_timestamp_timeout",
        "windows_use_single_network",
        "windows_disable_default_deny_all_policy",
        "windows_loopback_DSR",
        // The IPAM struct's untagged `Name`: nothing reads it, upstream included.
        "ipam.Name",
    ];

    /// Fields `NetConf` decodes that Go's struct does not have.
    const SERDE_ONLY: &[&str] = &[
        // Upstream reads host-local's routes from the raw IPAM config, not from its struct.
        "ipam.routes",
    ];

    /// Whether a serde field decodes what the Go type holds (a Go struct may be kept as an
    /// opaque JSON value on our side).
    fn same_kind(go: GoType, ours: &Shape) -> bool {
        let ours = match ours {
            Shape::Opt(inner) => inner,
            other => other,
        };
        match (go, ours) {
            (GoType::Str(_), Shape::Str)
            | (GoType::Int | GoType::Uint64, Shape::Int)
            | (GoType::Bool, Shape::Bool)
            | (GoType::AnyMap, Shape::Map)
            | (GoType::Struct(_), Shape::Any) => true,
            (GoType::StrSlice, Shape::Seq(item)) => **item == Shape::Str,
            (GoType::Struct(_), Shape::Struct(_)) => true,
            _ => false,
        }
    }

    fn go_name(go: GoType) -> &'static str {
        match go {
            GoType::Str(name) | GoType::StructSlice(_, name) => name,
            GoType::Int => "int",
            GoType::Uint64 => "uint64",
            GoType::Bool => "bool",
            GoType::StrSlice => "[]string",
            GoType::AnyMap => "map[string]interface {}",
            GoType::Struct(schema) => schema.type_name,
        }
    }

    /// Whether a dotted path names a field of Go's schema.
    fn in_schema(schema: &Schema, path: &str) -> bool {
        let (head, rest) = path.split_once('.').unwrap_or((path, ""));
        match schema.fields.iter().find(|(name, _)| *name == head) {
            Some((_, GoType::Struct(inner))) if !rest.is_empty() => in_schema(inner, rest),
            Some(_) => rest.is_empty(),
            None => false,
        }
    }

    /// Walks Go's schema and serde's fields side by side, naming every field one has and
    /// the other lacks, and every type that disagrees.
    fn differences(
        prefix: &str,
        schema: &Schema,
        fields: &[(&'static str, Shape)],
        out: &mut Vec<String>,
    ) {
        for (name, shape) in fields {
            let path = format!("{prefix}{name}");
            match schema.fields.iter().find(|(go, _)| go == name) {
                None if SERDE_ONLY.contains(&path.as_str()) => {}
                None => out.push(format!(
                    "`{path}` is in the serde struct (config::NetConf) but missing from \
                     gotypes' schema `{}`: add it there with its Go type \
                     (or to SERDE_ONLY if upstream's Go struct has no such field)",
                    schema.type_name
                )),
                Some(_) if SERDE_ONLY.contains(&path.as_str()) => {
                    out.push(format!("`{path}` is in both: drop it from SERDE_ONLY"))
                }
                Some((_, go)) => {
                    if !same_kind(*go, shape) {
                        out.push(format!(
                            "`{path}`: serde decodes {shape:?}, gotypes checks {}",
                            go_name(*go)
                        ));
                    }
                    // A Go struct we keep as an opaque value has no fields to compare.
                    if let GoType::Struct(inner) = go {
                        if !shape.fields().is_empty() {
                            differences(&format!("{path}."), inner, shape.fields(), out);
                        }
                    }
                }
            }
        }
        for (name, _) in schema.fields {
            let path = format!("{prefix}{name}");
            let decoded = fields.iter().any(|(ours, _)| ours == name);
            match (decoded, GO_ONLY.contains(&path.as_str())) {
                (false, false) => out.push(format!(
                    "`{path}` is in gotypes' schema `{}` but missing from the serde struct \
                     (config::NetConf): add the field there (or to GO_ONLY if we do not \
                     decode it)",
                    schema.type_name
                )),
                (true, true) => out.push(format!("`{path}` is decoded: drop it from GO_ONLY")),
                _ => {}
            }
        }
    }

    /// The one-declaration rule: every field of the serde struct (whose names the key
    /// folding is derived from) has its Go type in the schema, and every Go field is decoded
    /// or listed as Go-only, nested structs included.
    #[test]
    fn schema_and_serde_struct_agree() {
        let mut out = Vec::new();
        differences("", &NETCONF, shape_of::<NetConf>().fields(), &mut out);
        for stale in GO_ONLY.iter().filter(|p| !in_schema(&NETCONF, p)) {
            out.push(format!(
                "GO_ONLY names `{stale}`, which gotypes' schema lacks"
            ));
        }
        assert!(out.is_empty(), "{}", out.join("\n"));
    }

    /// The check above catches a half-added field, and says where it is missing.
    #[test]
    fn a_half_added_field_is_named() {
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Grown {
            name: String,
            new_field: bool,
        }
        static SMALL: Schema = Schema {
            type_name: "types.Small",
            struct_name: "Small",
            fields: &[
                ("name", STRING),
                ("mode", STRING),
                ("go_added", GoType::Int),
            ],
        };
        let mut out = Vec::new();
        differences("", &SMALL, shape_of::<Grown>().fields(), &mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        assert!(
            out[0].starts_with("`new_field` is in the serde struct"),
            "{}",
            out[0]
        );
        assert!(
            out[1].starts_with("`go_added` is in gotypes' schema"),
            "{}",
            out[1]
        );
    }

    fn err(v: Value) -> String {
        check_netconf(&v).unwrap_err()
    }

    #[test]
    fn struct_fields_refuse_arrays_and_scalars() {
        assert_eq!(
            err(json!({"name":"n","kubernetes":[]})),
            "json: cannot unmarshal array into Go struct field NetConf.kubernetes of type types.Kubernetes"
        );
        assert_eq!(
            err(json!({"policy":["k8s"]})),
            "json: cannot unmarshal array into Go struct field NetConf.policy of type types.Policy"
        );
        assert_eq!(
            err(json!({"feature_control":true})),
            "json: cannot unmarshal bool into Go struct field NetConf.feature_control of type types.FeatureControl"
        );
        assert_eq!(
            err(json!({"container_settings":"x"})),
            "json: cannot unmarshal string into Go struct field NetConf.container_settings of type types.ContainerSettings"
        );
        assert_eq!(
            err(json!({"args":"x"})),
            "json: cannot unmarshal string into Go struct field NetConf.args of type types.Args"
        );
        assert_eq!(
            err(json!({"args":{"org.apache.mesos":{"network_info":{"labels":{"labels":[{"key":1}]}}}}})),
            "json: cannot unmarshal number into Go struct field .args.org.apache.mesos.network_info.labels.labels.key of type string"
        );
    }

    #[test]
    fn nested_and_scalar_fields() {
        assert_eq!(
            err(json!({"policy":{"type":5}})),
            "json: cannot unmarshal number into Go struct field Policy.policy.type of type string"
        );
        assert_eq!(
            err(json!({"ipam":{"assign_ipv4":false}})),
            "json: cannot unmarshal bool into Go struct field .ipam.assign_ipv4 of type string"
        );
        assert_eq!(
            err(json!({"mtu":"1500"})),
            "json: cannot unmarshal string into Go struct field NetConf.mtu of type int"
        );
        assert_eq!(
            err(json!({"mtu":1.5})),
            "json: cannot unmarshal number 1.5 into Go struct field NetConf.mtu of type int"
        );
        assert_eq!(
            err(json!({"readiness_gates":"http://x"})),
            "json: cannot unmarshal string into Go struct field NetConf.readiness_gates of type []string"
        );
        assert_eq!(
            err(json!({"dataplane_options":[1]})),
            "json: cannot unmarshal array into Go struct field NetConf.dataplane_options of type map[string]interface {}"
        );
        // Case-insensitive keys, like Go.
        assert_eq!(
            err(json!({"Kubernetes":[]})),
            "json: cannot unmarshal array into Go struct field NetConf.kubernetes of type types.Kubernetes"
        );
    }

    #[test]
    fn what_go_accepts() {
        for ok in [
            json!({"name":"n","kubernetes":null,"policy":{},"args":{"cni":{"ips":["1.2.3.4"]}}}),
            json!({"mtu":1500,"num_queues":-1,"prevResult":[1,2],"unknown":[]}),
            json!({"runtimeConfig":{"portMappings":[{"hostPort":80}]},"dataplane_options":{"type":"grpc"}}),
            json!({"readiness_gates":["http://a",null],"ipam":{"ranges":[[{"subnet":"usePodCidr"}]]}}),
        ] {
            assert_eq!(check_netconf(&ok), Ok(()), "{ok}");
        }
    }
}
