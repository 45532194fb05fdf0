//! Go's renderings and parsers that upstream's texts and inputs depend on, in one place:
//! `strconv.ParseBool`, `strconv.ParseUint` and their `*strconv.NumError`, `strconv.Quote`
//! (`%q`), `syscall.Errno.Error()`, `*os.PathError` and `*os.ProcessState` (an exited
//! child's status) texts, `filepath.Clean`, and the `flag` package's parsing of boolean
//! flags.

use std::fmt::Write as _;
use std::io;
use std::os::unix::process::ExitStatusExt;
use std::path::{Component, Path, PathBuf};
use std::process::ExitStatus;

/// Go's `strconv.ParseBool`: `None` where Go answers "invalid syntax".
pub fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

/// Why `strconv` refused a number (`strconv.ErrSyntax`, `strconv.ErrRange`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum NumErrorKind {
    #[error("invalid syntax")]
    Syntax,
    #[error("value out of range")]
    Range,
}

/// Go's `*strconv.NumError`: `strconv.<Func>: parsing <quoted input>: <why>`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("strconv.{func}: parsing {}: {kind}", go_quote(.num))]
pub struct NumError {
    /// `ParseBool`, `ParseUint`, ...
    pub func: &'static str,
    /// The input, as given.
    pub num: String,
    pub kind: NumErrorKind,
}

/// Go's `strconv.ParseBool` with its error.
pub fn parse_bool_go(s: &str) -> Result<bool, NumError> {
    parse_bool(s).ok_or_else(|| NumError {
        func: "ParseBool",
        num: s.to_string(),
        kind: NumErrorKind::Syntax,
    })
}

/// Go's `strconv.Atoi` (a 64-bit `int`): an optional sign and decimal digits.
pub fn atoi(s: &str) -> Result<i64, NumError> {
    let err = |kind| NumError {
        func: "Atoi",
        num: s.to_string(),
        kind,
    };
    let (negative, digits) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let magnitude = parse_uint(digits, 10, 64).map_err(|e| err(e.kind))?;
    match negative {
        true if magnitude <= 1u64 << 63 => Ok((magnitude as i64).wrapping_neg()),
        false if magnitude < 1u64 << 63 => Ok(magnitude as i64),
        _ => Err(err(NumErrorKind::Range)),
    }
}

/// Go's `strconv.ParseUint(s, base, bits)` for an explicit `base` in 2..=36 (no `0x`-style
/// prefixes, no underscores, no sign) and `bits` in 1..=64: the same answer and the same
/// error, including which of the two errors a text with both an overflow and a bad digit
/// gets (the first met, left to right).
pub fn parse_uint(s: &str, base: u32, bits: u32) -> Result<u64, NumError> {
    let err = |kind| NumError {
        func: "ParseUint",
        num: s.to_string(),
        kind,
    };
    if s.is_empty() || !(2..=36).contains(&base) || !(1..=64).contains(&bits) {
        return Err(err(NumErrorKind::Syntax));
    }
    let base = u64::from(base);
    let cutoff = u64::MAX / base + 1;
    let max = if bits == 64 {
        u64::MAX
    } else {
        (1u64 << bits) - 1
    };
    let mut n: u64 = 0;
    for c in s.bytes() {
        let d = match c {
            b'0'..=b'9' => c - b'0',
            b'a'..=b'z' | b'A'..=b'Z' => c.to_ascii_lowercase() - b'a' + 10,
            _ => return Err(err(NumErrorKind::Syntax)),
        };
        let d = u64::from(d);
        if d >= base {
            return Err(err(NumErrorKind::Syntax));
        }
        if n >= cutoff {
            return Err(err(NumErrorKind::Range));
        }
        n *= base;
        match n.checked_add(d) {
            Some(n1) if n1 <= max => n = n1,
            _ => return Err(err(NumErrorKind::Range)),
        }
    }
    Ok(n)
}

/// Go's `strconv.Quote` of a string (`quote`).
pub fn go_quote(s: &str) -> String {
    quote(s.as_bytes())
}

/// Where nix's errno descriptions are worded otherwise than glibc's, from which Go's
/// table (`zerrors_linux_*.go`) is generated: Go's words.
const GO_WORDING: &[(i32, &str)] = &[
    (libc::EIO, "input/output error"),
    (libc::EBADF, "bad file descriptor"),
    (libc::EAGAIN, "resource temporarily unavailable"),
    (libc::ENOMEM, "cannot allocate memory"),
    (libc::EXDEV, "invalid cross-device link"),
    (libc::ENFILE, "too many open files in system"),
    (libc::ENOTTY, "inappropriate ioctl for device"),
    (libc::EDOM, "numerical argument out of domain"),
    (libc::ERANGE, "numerical result out of range"),
    (libc::EDEADLK, "resource deadlock avoided"),
    (libc::ENOLCK, "no locks available"),
    (libc::ELOOP, "too many levels of symbolic links"),
    (libc::EBADMSG, "bad message"),
    (
        libc::EILSEQ,
        "invalid or incomplete multibyte or wide character",
    ),
    (libc::ENOTSUP, "operation not supported"),
    (libc::ENETRESET, "network dropped connection on reset"),
    (libc::EDQUOT, "disk quota exceeded"),
];

/// Go's text for an errno (`syscall.Errno.Error()`), e.g. `file exists`, `no such device`:
/// nix's description with a lower-case first letter, Go's words where they differ, and
/// `errno <n>` for a number Go's table lacks. Independent of the running libc's `strerror`
/// (musl words many differently).
pub fn errno_text(errno: i32) -> String {
    let errno = errno.abs();
    if let Some((_, text)) = GO_WORDING.iter().find(|(code, _)| *code == errno) {
        return (*text).to_string();
    }
    let desc = nix::errno::Errno::from_raw(errno).desc();
    let mut chars = desc.chars();
    match chars.next() {
        Some(first) if desc != "Unknown errno" => first.to_lowercase().chain(chars).collect(),
        _ => format!("errno {errno}"),
    }
}

/// An I/O error as Go prints the errno inside it; an error that carries no errno keeps
/// Rust's text.
pub fn io_error_text(err: &io::Error) -> String {
    match err.raw_os_error() {
        Some(code) => errno_text(code),
        None => err.to_string(),
    }
}

/// Go's `*os.PathError` text: `<op> <path>: <errno text>`.
pub fn path_error(op: &str, path: impl AsRef<Path>, err: &io::Error) -> String {
    format!("{op} {}: {}", path.as_ref().display(), io_error_text(err))
}

/// Go's `strconv.Quote(string(bytes))`, what `%q` prints: in double quotes, `"` and `\\`
/// escaped, printable runes (`is_print`) as they are, `\a \b \f \n \r \t \v`, other
/// control characters as `\xNN`, other unprintable runes as `\uNNNN` / `\UNNNNNNNN`, and
/// each byte that is not part of valid UTF-8 as `\xNN`.
pub fn quote(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() + 2);
    out.push('"');
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            quote_rune(&mut out, c);
        }
        // Go decodes an invalid sequence one byte at a time, each a `RuneError` of width 1.
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
    out.push('"');
    out
}

fn quote_rune(out: &mut String, c: char) {
    let escaped = match c {
        '"' | '\\' => {
            out.push('\\');
            out.push(c);
            return;
        }
        c if is_print(c) => {
            out.push(c);
            return;
        }
        '\x07' => "\\a",
        '\x08' => "\\b",
        '\x0c' => "\\f",
        '\n' => "\\n",
        '\r' => "\\r",
        '\t' => "\\t",
        '\x0b' => "\\v",
        c if c < ' ' || c == '\x7f' => {
            let _ = write!(out, "\\x{:02x}", c as u32);
            return;
        }
        c if (c as u32) < 0x10000 => {
            let _ = write!(out, "\\u{:04x}", c as u32);
            return;
        }
        c => {
            let _ = write!(out, "\\U{:08x}", c as u32);
            return;
        }
    };
    out.push_str(escaped);
}

/// Go's `strconv.IsPrint` (`unicode.IsPrint`): letters, marks, numbers, punctuation,
/// symbols and the ASCII space, by Unicode 15.0's general categories (the version of Go's
/// tables).
pub fn is_print(c: char) -> bool {
    use unicode_general_category::{get_general_category, GeneralCategory as G};
    c == ' '
        || !matches!(
            get_general_category(c),
            G::Control
                | G::Format
                | G::LineSeparator
                | G::ParagraphSeparator
                | G::PrivateUse
                | G::SpaceSeparator
                | G::Surrogate
                | G::Unassigned
        )
}

/// Go's names of the signals (`syscall.Signal.String()` on Linux), by number from 1.
const SIGNALS: [&str; 31] = [
    "hangup",
    "interrupt",
    "quit",
    "illegal instruction",
    "trace/breakpoint trap",
    "aborted",
    "bus error",
    "floating point exception",
    "killed",
    "user defined signal 1",
    "segmentation fault",
    "user defined signal 2",
    "broken pipe",
    "alarm clock",
    "terminated",
    "stack fault",
    "child exited",
    "continued",
    "stopped (signal)",
    "stopped",
    "stopped (tty input)",
    "stopped (tty output)",
    "urgent I/O condition",
    "CPU time limit exceeded",
    "file size limit exceeded",
    "virtual timer expired",
    "profiling timer expired",
    "window changed",
    "I/O possible",
    "power failure",
    "bad system call",
];

/// Go's `syscall.Signal.String()`: its name, or `signal <n>`.
pub fn signal_text(signal: i32) -> String {
    usize::try_from(signal)
        .ok()
        .and_then(|n| n.checked_sub(1))
        .and_then(|i| SIGNALS.get(i))
        .map_or_else(|| format!("signal {signal}"), |s| (*s).to_string())
}

/// A finished child's status as Go prints it (`*os.ProcessState`, the text of an
/// `*exec.ExitError`): `exit status 1`, `signal: killed`, `signal: aborted (core dumped)`.
pub fn exit_status_text(status: &ExitStatus) -> String {
    let mut text = match (status.code(), status.signal(), status.stopped_signal()) {
        (Some(code), _, _) => format!("exit status {code}"),
        (None, Some(signal), _) => format!("signal: {}", signal_text(signal)),
        (None, None, Some(signal)) => format!("stop signal: {}", signal_text(signal)),
        (None, None, None) if status.continued() => "continued".to_string(),
        (None, None, None) => String::new(),
    };
    if status.core_dumped() {
        text.push_str(" (core dumped)");
    }
    text
}

/// Go's `filepath.Clean`, lexically: repeated and trailing separators and `.` removed, `..`
/// resolved against what precedes it (at the root it stays the root); empty is `.`.
pub fn clean_path(path: &Path) -> PathBuf {
    let mut parts: Vec<Component> = Vec::new();
    for c in path.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => match parts.last() {
                Some(Component::Normal(_)) => {
                    parts.pop();
                }
                Some(Component::RootDir | Component::Prefix(_)) => {}
                _ => parts.push(c),
            },
            other => parts.push(other),
        }
    }
    match parts.is_empty() {
        true => PathBuf::from("."),
        false => parts.iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_bool_as_strconv() {
        for t in ["1", "t", "T", "TRUE", "true", "True"] {
            assert_eq!(parse_bool(t), Some(true), "{t}");
        }
        for f in ["0", "f", "F", "FALSE", "false", "False"] {
            assert_eq!(parse_bool(f), Some(false), "{f}");
        }
        for bad in ["", "yes", "tRUE", " true", "2"] {
            assert_eq!(parse_bool(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn num_errors_as_strconv() {
        assert_eq!(
            parse_bool_go("").unwrap_err().to_string(),
            r#"strconv.ParseBool: parsing "": invalid syntax"#
        );
        assert_eq!(parse_bool_go("T"), Ok(true));
        assert_eq!(parse_uint("0600", 8, 32), Ok(0o600));
        assert_eq!(parse_uint("37777777777", 8, 32), Ok(0xffff_ffff));
        // Each as upstream's installer printed it for TEST_FILE_PERMISSION.
        for (text, why) in [
            ("", "invalid syntax"),
            ("0o644", "invalid syntax"),
            ("0x1a4", "invalid syntax"),
            ("08", "invalid syntax"),
            ("-1", "invalid syntax"),
            (" 0644", "invalid syntax"),
            ("40000000000", "value out of range"),
            ("777777777777", "value out of range"),
            // The overflow is met before the bad digit, and the bad digit before it.
            ("777777777777x", "value out of range"),
            ("7x77777777777", "invalid syntax"),
        ] {
            assert_eq!(
                parse_uint(text, 8, 32).unwrap_err().to_string(),
                format!("strconv.ParseUint: parsing \"{text}\": {why}"),
                "{text:?}"
            );
        }
        assert_eq!(parse_uint("18446744073709551615", 10, 64), Ok(u64::MAX));
        assert_eq!(
            parse_uint("18446744073709551616", 10, 64).map_err(|e| e.kind),
            Err(NumErrorKind::Range)
        );
    }

    #[test]
    fn quote_as_go() {
        assert_eq!(go_quote(""), r#""""#);
        assert_eq!(go_quote("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(
            go_quote("\t\n\u{1}\u{7f}\u{85}é"),
            r#""\t\n\x01\x7f\u0085é""#
        );
    }

    #[test]
    fn errno_texts_match_go() {
        assert_eq!(errno_text(libc::EEXIST), "file exists");
        assert_eq!(errno_text(-libc::ENODEV), "no such device");
        assert_eq!(errno_text(libc::ENOENT), "no such file or directory");
        assert_eq!(errno_text(libc::EPERM), "operation not permitted");
        assert_eq!(errno_text(libc::ENOTEMPTY), "directory not empty");
        assert_eq!(errno_text(libc::ERANGE), "numerical result out of range");
        assert_eq!(errno_text(libc::EAGAIN), "resource temporarily unavailable");
        assert_eq!(errno_text(41), "errno 41");
    }

    /// Go's table is glibc's `strerror` texts, lower-cased: every errno Go names reads the
    /// same here (41 and 58 are unassigned: Go prints `errno <n>`).
    #[cfg(target_env = "gnu")]
    #[test]
    fn errno_texts_are_glibcs() {
        let mut differ = Vec::new();
        for code in (1..=133).filter(|c| *c != 41 && *c != 58) {
            let rust = io::Error::from_raw_os_error(code).to_string();
            let glibc = rust.split(" (os error ").next().unwrap_or_default();
            let mut chars = glibc.chars();
            let lowered: String = match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => String::new(),
            };
            if errno_text(code) != lowered {
                differ.push(format!("({code}, {lowered:?}) not {:?}", errno_text(code)));
            }
        }
        assert!(differ.is_empty(), "{}", differ.join("\n"));
    }

    #[test]
    fn io_and_path_errors() {
        let enoent = io::Error::from_raw_os_error(libc::ENOENT);
        assert_eq!(io_error_text(&enoent), "no such file or directory");
        assert_eq!(
            path_error("open", "/proc/sys/x", &enoent),
            "open /proc/sys/x: no such file or directory"
        );
        assert_eq!(
            path_error("open", Path::new("/x"), &enoent),
            "open /x: no such file or directory"
        );
        let custom = io::Error::other("Custom text");
        assert_eq!(io_error_text(&custom), "Custom text");
        assert_eq!(path_error("read", "/y", &custom), "read /y: Custom text");
    }

    #[test]
    fn quote_as_go_prints_q() {
        // Each as Go 1.26's `fmt.Sprintf("%q", s)` prints it.
        assert_eq!(quote(b""), r#""""#);
        assert_eq!(quote(b"oops: not json\n"), r#""oops: not json\n""#);
        assert_eq!(
            quote("boom \"quoted\"\ttab\nline2 <&> caf\u{e9} nbsp\u{a0} ".as_bytes()),
            r#""boom \"quoted\"\ttab\nline2 <&> café nbsp\u00a0 ""#
        );
        assert_eq!(
            quote(b"bad\xff ctl\x01 del\x7f"),
            r#""bad\xff ctl\x01 del\x7f""#
        );
        assert_eq!(
            quote("zw\u{200b} \\ \u{7}\u{8}\u{b}\u{c}\r".as_bytes()),
            r#""zw\u200b \\ \a\b\v\f\r""#
        );
        // A truncated sequence is one `\x` per byte; a valid U+FFFD and astral runes stay.
        assert_eq!(
            quote(b"\xe2\x82 \xef\xbf\xbd \xf0\x9f\xa6\xb3"),
            "\"\\xe2\\x82 \u{fffd} \u{1f9b3}\""
        );
        // Unassigned and private-use code points.
        assert_eq!(
            quote("\u{378}\u{e000}\u{10ffff}".as_bytes()),
            r#""\u0378\ue000\U0010ffff""#
        );
    }

    #[test]
    fn exit_statuses_as_go_prints_them() {
        assert_eq!(
            exit_status_text(&ExitStatus::from_raw(1 << 8)),
            "exit status 1"
        );
        assert_eq!(exit_status_text(&ExitStatus::from_raw(0)), "exit status 0");
        assert_eq!(exit_status_text(&ExitStatus::from_raw(9)), "signal: killed");
        assert_eq!(
            exit_status_text(&ExitStatus::from_raw(6 | 0x80)),
            "signal: aborted (core dumped)"
        );
        assert_eq!(
            exit_status_text(&ExitStatus::from_raw(34)),
            "signal: signal 34"
        );
    }

    #[test]
    fn clean_paths_as_filepath_clean() {
        for (raw, clean) in [
            ("/opt/cni/bin/x", "/opt/cni/bin/x"),
            ("/opt//cni/./bin/x", "/opt/cni/bin/x"),
            ("/opt/cni/../bin/x", "/opt/bin/x"),
            ("/../x", "/x"),
            ("bin/x", "bin/x"),
            ("./bin/x", "bin/x"),
            ("../../x", "../../x"),
            ("a/../../x", "../x"),
            ("", "."),
        ] {
            assert_eq!(clean_path(Path::new(raw)), PathBuf::from(clean), "{raw}");
        }
    }
}

/// Why Go's `flag.FlagSet.Parse` stopped (with `ExitOnError`: `Help` exits 0 after the
/// usage, `Refused` prints its text and the usage and exits 2).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FlagError {
    Help,
    Refused(String),
}

/// Go's `flag.FlagSet.Parse` for a set of boolean flags (`names`, all `false` at first):
/// `-name` or `--name`, optionally `=value` (`strconv.ParseBool`'s values), each later one
/// winning; parsing stops at the first argument that is not a flag (`-` or anything not
/// starting with `-`) and after `--`. Returns each flag's value, in `names`' order.
pub fn parse_bool_flags<const N: usize>(
    args: &[String],
    names: [&str; N],
) -> Result<[bool; N], FlagError> {
    let mut values = [false; N];
    for arg in args {
        let Some(flag) = arg.strip_prefix('-').filter(|f| !f.is_empty()) else {
            break;
        };
        let flag = match flag.strip_prefix('-') {
            Some("") => break,
            Some(f) => f,
            None => flag,
        };
        if flag.starts_with(['-', '=']) {
            return Err(FlagError::Refused(format!("bad flag syntax: {arg}")));
        }
        // `=` cannot be the name's first character: that was refused above.
        let (name, value) = match flag.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (flag, None),
        };
        let Some(i) = names.iter().position(|n| *n == name) else {
            if name == "h" || name == "help" {
                return Err(FlagError::Help);
            }
            return Err(FlagError::Refused(format!(
                "flag provided but not defined: -{name}"
            )));
        };
        values[i] = match value {
            None => true,
            Some(v) => parse_bool(v).ok_or_else(|| {
                FlagError::Refused(format!(
                    "invalid boolean value {} for -{name}: parse error",
                    go_quote(v)
                ))
            })?,
        };
    }
    Ok(values)
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<[bool; 2], FlagError> {
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        parse_bool_flags(&args, ["t", "v"])
    }

    #[test]
    fn boolean_flags_parse_as_go_parses_them() {
        assert_eq!(parse(&[]), Ok([false, false]));
        assert_eq!(parse(&["-v"]), Ok([false, true]));
        assert_eq!(parse(&["--t", "-v=T"]), Ok([true, true]));
        assert_eq!(parse(&["-v", "-v=false"]), Ok([false, false]));
        assert_eq!(parse(&["foo", "-v"]), Ok([false, false]));
        assert_eq!(parse(&["-", "-v"]), Ok([false, false]));
        assert_eq!(parse(&["--", "-v"]), Ok([false, false]));
        assert_eq!(parse(&["-h"]), Err(FlagError::Help));
        assert_eq!(parse(&["-v", "--help"]), Err(FlagError::Help));
        let refused = |t: &str| Err(FlagError::Refused(t.to_string()));
        assert_eq!(
            parse(&["-version"]),
            refused("flag provided but not defined: -version")
        );
        assert_eq!(
            parse(&["-v", "--x=1"]),
            refused("flag provided but not defined: -x")
        );
        assert_eq!(
            parse(&["-v=yes"]),
            refused("invalid boolean value \"yes\" for -v: parse error")
        );
        assert_eq!(parse(&["---v"]), refused("bad flag syntax: ---v"));
        assert_eq!(parse(&["-=v"]), refused("bad flag syntax: -=v"));
    }
}
