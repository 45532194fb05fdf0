//! A delegated plugin's failure as libcni reports it (`invoke/raw_exec.go`, `pluginErr`):
//! always a `types.Error`, which Go's skel prints as it is. When the plugin exited non-zero:
//! * nothing on stdout or stderr: `netplugin failed with no error message: <exec error>`
//!   (Go's text of the exit: `exit status 1`, `signal: killed`; or of the start:
//!   `fork/exec <path>: permission denied`);
//! * only stderr: `netplugin failed: "<stderr>"` (Go's `%q`);
//! * stdout that does not decode as an error object (Go's `json.Unmarshal` into
//!   `types.Error`): `netplugin failed but error parsing its diagnostic message "<stdout>":
//!   <Go's JSON error>`, with the `code` and `details` it did decode;
//! * stdout that decodes: that error, code, msg and details as the plugin wrote them.
//!
//! The code is the error object's: what the plugin's stdout gave (Go's zero value where its
//! object had none), else none at all (`CODE_UNSET`, 0: libcni words the failure itself),
//! never the 999 Go's skel gives an untyped error.

use std::path::PathBuf;
use std::process::ExitStatus;

use crate::support::gocompat;
use crate::support::gojson::{self, GoJsonError};

/// Why the plugin did not succeed, in Go's words (`*exec.ExitError`, or the `*os.PathError`
/// of the exec).
#[derive(Debug, thiserror::Error)]
pub enum ExecFailure {
    /// It ran and exited non-zero or was killed.
    #[error("{}", gocompat::exit_status_text(.0))]
    Exited(ExitStatus),
    /// It could not be started.
    #[error("{}", gocompat::path_error("fork/exec", .path, .source))]
    Start {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A failed plugin, as libcni's `pluginErr` makes it. Its text is Go's `types.Error.Error()`:
/// the message, then `; <details>` when there are details.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// Its own error object, passed through.
    #[error("{}", with_details(msg, details))]
    Reported {
        code: u64,
        msg: String,
        details: String,
    },
    /// Exited without a word on stdout or stderr.
    #[error("netplugin failed with no error message: {0}")]
    Silent(#[source] ExecFailure),
    /// Exited with something on stderr only.
    #[error("netplugin failed: {}", gocompat::quote(.0))]
    Stderr(Vec<u8>),
    /// Exited with something on stdout that is not an error object. `code` and `details`
    /// are what Go decoded of it before giving up.
    #[error(
        "{}",
        with_details(&format!("netplugin failed but error parsing its diagnostic message {}: {source}", gocompat::quote(stdout)), details)
    )]
    Undecodable {
        stdout: Vec<u8>,
        #[source]
        source: GoJsonError,
        code: u64,
        details: String,
    },
}

fn with_details(msg: &str, details: &str) -> String {
    match details.is_empty() {
        true => msg.to_string(),
        false => format!("{msg}; {details}"),
    }
}

impl PluginError {
    /// `pluginErr`: what a plugin that did not succeed left on stdout and stderr.
    pub fn from_output(failure: ExecFailure, stdout: Vec<u8>, stderr: Vec<u8>) -> PluginError {
        if stdout.is_empty() {
            return match stderr.is_empty() {
                true => PluginError::Silent(failure),
                false => PluginError::Stderr(stderr),
            };
        }
        match gojson::unmarshal_cni_error(&stdout) {
            (e, None) => PluginError::Reported {
                code: e.code,
                msg: e.msg,
                details: e.details,
            },
            (e, Some(source)) => PluginError::Undecodable {
                stdout,
                source,
                code: e.code,
                details: e.details,
            },
        }
    }

    /// The `code` the plugin's stdout gave (0 where its object had none); `None` where
    /// there was nothing to decode.
    pub fn code(&self) -> Option<u64> {
        match self {
            PluginError::Reported { code, .. } | PluginError::Undecodable { code, .. } => {
                Some(*code)
            }
            PluginError::Silent(_) | PluginError::Stderr(_) => None,
        }
    }

    /// The error object's `msg`.
    pub fn msg(&self) -> String {
        match self {
            PluginError::Reported { msg, .. } => msg.clone(),
            PluginError::Undecodable { stdout, source, .. } => format!(
                "netplugin failed but error parsing its diagnostic message {}: {source}",
                gocompat::quote(stdout)
            ),
            other => other.to_string(),
        }
    }

    /// The error object's `details`.
    pub fn details(&self) -> &str {
        match self {
            PluginError::Reported { details, .. } | PluginError::Undecodable { details, .. } => {
                details
            }
            PluginError::Silent(_) | PluginError::Stderr(_) => "",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    fn exit(code: i32) -> ExecFailure {
        ExecFailure::Exited(ExitStatus::from_raw(code << 8))
    }

    /// As upstream v3.32.1's `calico` reported a delegated IPAM plugin that exited 1 (msg,
    /// code, details of the error it printed).
    #[test]
    fn libcni_texts_and_codes() {
        /// The error, and its (code, msg, details).
        type Case = (PluginError, (Option<u64>, &'static str, &'static str));
        let cases: Vec<Case> = vec![
            (
                PluginError::from_output(exit(1), vec![], vec![]),
                (
                    None,
                    "netplugin failed with no error message: exit status 1",
                    "",
                ),
            ),
            (
                PluginError::from_output(
                    ExecFailure::Exited(ExitStatus::from_raw(9)),
                    vec![],
                    vec![],
                ),
                (
                    None,
                    "netplugin failed with no error message: signal: killed",
                    "",
                ),
            ),
            (
                PluginError::from_output(exit(1), vec![], b"boom \"q\"\n".to_vec()),
                (None, r#"netplugin failed: "boom \"q\"\n""#, ""),
            ),
            (
                PluginError::from_output(exit(1), b"oops: not json\n".to_vec(), b"x".to_vec()),
                (
                    Some(0),
                    r#"netplugin failed but error parsing its diagnostic message "oops: not json\n": invalid character 'o' looking for beginning of value"#,
                    "",
                ),
            ),
            (
                PluginError::from_output(
                    exit(1),
                    br#"{"code": "7", "msg": "m", "details": "dd"}"#.to_vec(),
                    vec![],
                ),
                (
                    Some(0),
                    r#"netplugin failed but error parsing its diagnostic message "{\"code\": \"7\", \"msg\": \"m\", \"details\": \"dd\"}": json: cannot unmarshal string into Go struct field Error.code of type uint"#,
                    "dd",
                ),
            ),
            (
                PluginError::from_output(
                    exit(1),
                    br#"{"code": 7, "msg": "bad config", "details": "some details"}"#.to_vec(),
                    vec![],
                ),
                (Some(7), "bad config", "some details"),
            ),
            (
                PluginError::from_output(exit(1), b"null".to_vec(), vec![]),
                (Some(0), "", ""),
            ),
        ];
        for (e, (code, msg, details)) in cases {
            assert_eq!(
                (e.code(), e.msg().as_str(), e.details()),
                (code, msg, details)
            );
        }
    }

    #[test]
    fn text_is_gos_error_method() {
        let e = PluginError::from_output(
            exit(1),
            br#"{"code":7,"msg":"m","details":"d"}"#.to_vec(),
            vec![],
        );
        assert_eq!(e.to_string(), "m; d");
        let start = ExecFailure::Start {
            path: "/opt/cni/bin/x".into(),
            source: std::io::Error::from_raw_os_error(libc::EACCES),
        };
        assert_eq!(
            PluginError::Silent(start).to_string(),
            "netplugin failed with no error message: fork/exec /opt/cni/bin/x: permission denied"
        );
    }
}
