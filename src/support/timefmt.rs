//! Time text forms upstream writes: RFC 3339 UTC seconds (`metav1.Time`), Go's
//! `Time.String()` (IPAM `timestamp` attribute) and Unix nanoseconds (block sequence numbers).
//! UTC only; no time-zone database needed.

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds and nanoseconds since the Unix epoch.
pub fn now() -> (i64, u32) {
    match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => (d.as_secs() as i64, d.subsec_nanos()),
        Err(_) => (0, 0),
    }
}

pub fn now_unix_nanos() -> u64 {
    let (s, n) = now();
    (s as u64).saturating_mul(1_000_000_000) + u64::from(n)
}

/// `2025-01-02T03:04:05Z`
pub fn rfc3339(secs: i64) -> String {
    let (y, mo, d, h, mi, s) = civil(secs);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

pub fn now_rfc3339() -> String {
    rfc3339(now().0)
}

/// Go's `time.Now().UTC().String()`: `2025-01-02 03:04:05.12345 +0000 UTC` (fraction with
/// trailing zeros trimmed, omitted when zero).
pub fn go_time_string(secs: i64, nanos: u32) -> String {
    let (y, mo, d, h, mi, s) = civil(secs);
    let mut frac = String::new();
    if nanos != 0 {
        frac = format!(".{nanos:09}");
        while frac.ends_with('0') {
            frac.pop();
        }
    }
    format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}{frac} +0000 UTC")
}

pub fn now_go_string() -> String {
    let (s, n) = now();
    go_time_string(s, n)
}

/// Parses `YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM)` to Unix seconds.
pub fn parse_rfc3339(s: &str) -> Option<i64> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || b[13] != b':' || b[16] != b':' {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { s.get(r)?.parse().ok() };
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    let mut rest = &s[19..];
    if let Some(r) = rest.strip_prefix('.') {
        let digits = r.bytes().take_while(u8::is_ascii_digit).count();
        rest = &r[digits..];
    }
    let offset = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6 => {
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            let oh: i64 = rest.get(1..3)?.parse().ok()?;
            let om: i64 = rest.get(4..6)?.parse().ok()?;
            sign * (oh * 3600 + om * 60)
        }
        _ => return None,
    };
    Some(days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec - offset)
}

/// UTC year, month, day, hour, minute and second of Unix seconds `secs`.
pub fn civil(secs: i64) -> (i64, u32, u32, u32, u32, u32) {
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    let (y, m, d) = civil_from_days(days);
    (
        y,
        m,
        d,
        (rem / 3600) as u32,
        ((rem % 3600) / 60) as u32,
        (rem % 60) as u32,
    )
}

// Howard Hinnant's civil-from-days / days-from-civil algorithms.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// Days since the Unix epoch of the proleptic Gregorian date `y-m-d` (no range checks).
pub fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The number of days in month `m` (1–12) of year `y`, as Go's `time` counts them.
pub fn days_in_month(y: i64, m: u32) -> u32 {
    match m {
        2 if y % 4 == 0 && (y % 100 != 0 || y % 400 == 0) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// A random (version 4) UUID, as Kubernetes/libcalico-go generate for `metadata.uid`.
pub fn new_uuid() -> String {
    let mut b = [0u8; 16];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .is_err()
    {
        // Fall back to time + pid: unique enough for an object UID.
        let n = now_unix_nanos().to_le_bytes();
        b[..8].copy_from_slice(&n);
        b[8..12].copy_from_slice(&std::process::id().to_le_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        // 2025-01-02T03:04:05Z
        assert_eq!(rfc3339(1_735_787_045), "2025-01-02T03:04:05Z");
        assert_eq!(
            go_time_string(1_735_787_045, 123_450_000),
            "2025-01-02 03:04:05.12345 +0000 UTC"
        );
        assert_eq!(
            go_time_string(1_735_787_045, 0),
            "2025-01-02 03:04:05 +0000 UTC"
        );
        assert_eq!(parse_rfc3339("2025-01-02T03:04:05Z"), Some(1_735_787_045));
        assert_eq!(
            parse_rfc3339("2025-01-02T04:04:05.5+01:00"),
            Some(1_735_787_045)
        );
        assert_eq!(parse_rfc3339("garbage"), None);
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
    }

    #[test]
    fn uuid_shape() {
        let u = new_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(u, new_uuid());
    }
}
