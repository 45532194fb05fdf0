//! CNI_ARGS (`K=V;K=V`) parsing with libcni v1.3's `LoadArgs` rules: pairs are taken in
//! order; a pair must have exactly one `=`; a known key's value must parse as its type (the
//! first bad one fails at once); unknown keys are reported together at the end unless
//! `IgnoreUnknown` is true. Keys match exactly (case-sensitive), the last pair of a key wins.

use std::collections::BTreeMap;
use std::net::IpAddr;

use super::CniError;

use crate::support::gocompat::go_quote;

/// How a known key's value is decoded (the Go field's `UnmarshalText`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgKind {
    /// `UnmarshallableString`: anything.
    Str,
    /// `UnmarshallableBool`: `1`/`true`/`0`/`false`, any case.
    Bool,
    /// `net.IP`: an address, or empty for none.
    Ip,
}

/// `IgnoreUnknown`, which every args struct embeds (`types.CommonArgs`).
pub const IGNORE_UNKNOWN: (&str, ArgKind) = ("IgnoreUnknown", ArgKind::Bool);

/// Splits CNI_ARGS into pairs.
pub fn parse_cni_args(s: &str) -> Result<Vec<(String, String)>, CniError> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(';')
        .map(|pair| {
            let kv: Vec<&str> = pair.split('=').collect();
            if kv.len() != 2 {
                return Err(CniError::internal(format!(
                    "ARGS: invalid pair {}",
                    go_quote(pair)
                )));
            }
            Ok((kv[0].to_string(), kv[1].to_string()))
        })
        .collect()
}

/// Decodes one value as Go would; `Err` is the inner error text.
fn decode(kind: ArgKind, value: &str) -> Result<(), String> {
    match kind {
        ArgKind::Str => Ok(()),
        ArgKind::Bool => match value.to_ascii_lowercase().as_str() {
            "1" | "true" | "0" | "false" => Ok(()),
            other => Err(format!("boolean unmarshal error: invalid input {other}")),
        },
        ArgKind::Ip if value.is_empty() => Ok(()),
        ArgKind::Ip => value
            .parse::<IpAddr>()
            .map(|_| ())
            .map_err(|_| format!("invalid IP address: {value}")),
    }
}

/// The known pairs as a map (values checked); unknown keys fail unless IgnoreUnknown is set.
pub fn load_args(s: &str, known: &[(&str, ArgKind)]) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    let mut unknown = Vec::new();
    for (k, v) in parse_cni_args(s)? {
        let Some((_, kind)) = known.iter().find(|(name, _)| *name == k) else {
            unknown.push(format!("{k}={v}"));
            continue;
        };
        decode(*kind, &v).map_err(|e| {
            CniError::internal(format!(
                "ARGS: error parsing value of pair {}: {e}",
                go_quote(&format!("{k}={v}"))
            ))
        })?;
        out.insert(k, v);
    }
    let ignore = out
        .get(IGNORE_UNKNOWN.0)
        .is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if !unknown.is_empty() && !ignore {
        let list = unknown
            .iter()
            .map(|p| go_quote(p))
            .collect::<Vec<_>>()
            .join(" ");
        return Err(CniError::internal(format!("ARGS: unknown args [{list}]")));
    }
    Ok(out)
}

/// `calico` runs with `IgnoreUnknown=1` prepended, so delegated plugins inherit it.
pub fn prepend_ignore_unknown(args: &str) -> String {
    if args.is_empty() {
        "IgnoreUnknown=1".to_string()
    } else {
        format!("IgnoreUnknown=1;{args}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_unknowns() {
        assert!(parse_cni_args("").unwrap().is_empty());
        assert_eq!(
            parse_cni_args("A=1;B=2").unwrap(),
            vec![("A".into(), "1".into()), ("B".into(), "2".into())]
        );
        assert_eq!(
            parse_cni_args("A=1;B").unwrap_err().msg,
            "ARGS: invalid pair \"B\""
        );
        assert_eq!(
            parse_cni_args("A=1=2").unwrap_err().msg,
            "ARGS: invalid pair \"A=1=2\""
        );
        let known = [
            IGNORE_UNKNOWN,
            ("K8S_POD_NAME", ArgKind::Str),
            ("IP", ArgKind::Ip),
        ];
        assert_eq!(
            load_args("K8S_POD_NAME=p;X=1;Y=2", &known).unwrap_err().msg,
            "ARGS: unknown args [\"X=1\" \"Y=2\"]"
        );
        let m = load_args("IgnoreUnknown=1;K8S_POD_NAME=p;X=1", &known).unwrap();
        assert_eq!(m.get("K8S_POD_NAME").map(String::as_str), Some("p"));
        assert!(load_args("IgnoreUnknown=TRUE;X=1", &known).is_ok());
        assert_eq!(
            load_args("IgnoreUnknown=Maybe", &known).unwrap_err().msg,
            "ARGS: error parsing value of pair \"IgnoreUnknown=Maybe\": boolean unmarshal error: invalid input maybe"
        );
        // A bad value is reported before unknown keys, even after them.
        assert_eq!(
            load_args("FOO=1;IP=abc", &known).unwrap_err().msg,
            "ARGS: error parsing value of pair \"IP=abc\": invalid IP address: abc"
        );
        assert_eq!(
            load_args("IP=10.0.0.300", &known).unwrap_err().msg,
            "ARGS: error parsing value of pair \"IP=10.0.0.300\": invalid IP address: 10.0.0.300"
        );
        assert!(load_args("IP=", &known).is_ok());
        // A later IgnoreUnknown=0 wins over an earlier 1.
        assert!(load_args("IgnoreUnknown=1;X=1;IgnoreUnknown=0", &known).is_err());
        assert_eq!(prepend_ignore_unknown(""), "IgnoreUnknown=1");
        assert_eq!(prepend_ignore_unknown("A=1"), "IgnoreUnknown=1;A=1");
    }
}
