//! CNI_ARGS (`K=V;K=V`) parsing with libcni's `LoadArgs` rules: a pair must have exactly one
//! `=`; keys are matched exactly against what the plugin knows; unknown keys are an error
//! unless `IgnoreUnknown` is `1`/`true`.

use std::collections::BTreeMap;

use super::CniError;

fn go_quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| format!("\"{s}\""))
}

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

/// The known pairs as a map; unknown keys fail unless IgnoreUnknown is set.
pub fn load_args(s: &str, known: &[&str]) -> Result<BTreeMap<String, String>, CniError> {
    let mut out = BTreeMap::new();
    let mut unknown = Vec::new();
    for (k, v) in parse_cni_args(s)? {
        if known.contains(&k.as_str()) {
            out.insert(k, v);
        } else {
            unknown.push(format!("{k}={v}"));
        }
    }
    let ignore = match out.get("IgnoreUnknown").map(String::as_str) {
        None => false,
        Some(v) if v == "1" || v.eq_ignore_ascii_case("true") => true,
        Some(v) if v == "0" || v.eq_ignore_ascii_case("false") => false,
        Some(v) => {
            return Err(CniError::internal(format!(
                "ARGS: error parsing value of pair {}: boolean unmarshal error: invalid input {v}",
                go_quote(&format!("IgnoreUnknown={v}"))
            )))
        }
    };
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
        let known = ["IgnoreUnknown", "K8S_POD_NAME"];
        assert_eq!(
            load_args("K8S_POD_NAME=p;X=1", &known).unwrap_err().msg,
            "ARGS: unknown args [\"X=1\"]"
        );
        let m = load_args("IgnoreUnknown=1;K8S_POD_NAME=p;X=1", &known).unwrap();
        assert_eq!(m.get("K8S_POD_NAME").map(String::as_str), Some("p"));
        assert!(load_args("IgnoreUnknown=TRUE;X=1", &known).is_ok());
        assert!(load_args("IgnoreUnknown=maybe", &known).is_err());
        assert_eq!(prepend_ignore_unknown(""), "IgnoreUnknown=1");
        assert_eq!(prepend_ignore_unknown("A=1"), "IgnoreUnknown=1;A=1");
    }
}
