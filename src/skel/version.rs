//! Supported CNI versions, negotiation and the VERSION answer (libcni `pkg/version`).

/// What both plugins support, in order. Upstream Calico stops at 1.0.0; 1.1.0 adds STATUS,
/// GC and the 1.1 result fields (a 1.1.0 result is printed like a 1.0.0 one).
pub const SUPPORTED: &[&str] = &[
    "0.1.0", "0.2.0", "0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0",
];

/// The version the VERSION answer names as its own (libcni v1.3's "current").
pub const CURRENT: &str = "1.1.0";

pub fn is_supported(v: &str) -> bool {
    SUPPORTED.contains(&v)
}

/// `major.minor.patch` as numbers; missing parts count as 0, garbage as None.
fn parse(v: &str) -> Option<(u64, u64, u64)> {
    let mut it = v.split('.');
    let major = it.next()?.parse().ok()?;
    let minor = it.next().map_or(Some(0), |s| s.parse().ok())?;
    let patch = it.next().map_or(Some(0), |s| s.parse().ok())?;
    it.next().is_none().then_some((major, minor, patch))
}

/// `a >= b` as semantic versions (an unparsable `a` is never greater).
pub fn version_ge(a: &str, b: &str) -> bool {
    match (parse(a), parse(b)) {
        (Some(x), Some(y)) => x >= y,
        _ => false,
    }
}

/// `{"cniVersion":"1.1.0","supportedVersions":[...]}` (compact; the caller adds "\n").
pub fn version_json() -> String {
    let list = SUPPORTED
        .iter()
        .map(|v| format!("\"{v}\""))
        .collect::<Vec<_>>()
        .join(",");
    format!("{{\"cniVersion\":\"{CURRENT}\",\"supportedVersions\":[{list}]}}")
}

/// The details of an "incompatible CNI versions" error, Go `%q` style.
pub fn incompatible_details(config: &str) -> String {
    let list = SUPPORTED
        .iter()
        .map(|v| format!("\"{v}\""))
        .collect::<Vec<_>>()
        .join(" ");
    format!("config is \"{config}\", plugin supports [{list}]")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_and_answer() {
        assert!(version_ge("1.0.0", "0.4.0"));
        assert!(version_ge("0.4.0", "0.4.0"));
        assert!(!version_ge("0.3.1", "0.4.0"));
        assert!(version_ge("1.1.0", "1.1.0"));
        assert!(!version_ge("x", "0.4.0"));
        assert!(is_supported("0.3.0") && is_supported("1.1.0") && !is_supported("1.2.0"));
        assert_eq!(
            version_json(),
            r#"{"cniVersion":"1.1.0","supportedVersions":["0.1.0","0.2.0","0.3.0","0.3.1","0.4.0","1.0.0","1.1.0"]}"#
        );
        assert_eq!(
            incompatible_details("1.2.0"),
            r#"config is "1.2.0", plugin supports ["0.1.0" "0.2.0" "0.3.0" "0.3.1" "0.4.0" "1.0.0" "1.1.0"]"#
        );
    }
}
