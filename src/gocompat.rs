//! Go's renderings and parsers that upstream's texts and inputs depend on, in one place:
//! `strconv.ParseBool`, `syscall.Errno.Error()` and `*os.PathError` texts.

use std::io;
use std::path::Path;

/// Go's `strconv.ParseBool`: `None` where Go answers "invalid syntax".
pub fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
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
}
