//! The CNI error object (`{"code","msg","details"}`) and the spec's well-known codes.

/// CNI spec error codes used by the skel.
pub const CODE_INCOMPATIBLE_VERSION: u64 = 1;
pub const CODE_UNSUPPORTED_FIELD: u64 = 2;
pub const CODE_UNKNOWN_CONTAINER: u64 = 3;
pub const CODE_INVALID_ENV: u64 = 4;
pub const CODE_IO_FAILURE: u64 = 5;
pub const CODE_DECODING_FAILURE: u64 = 6;
pub const CODE_INVALID_NETWORK_CONFIG: u64 = 7;
pub const CODE_INVALID_NETNS: u64 = 8;
pub const CODE_TRY_AGAIN_LATER: u64 = 11;
pub const CODE_NOT_AVAILABLE: u64 = 50;
pub const CODE_LIMITED_CONNECTIVITY: u64 = 51;
pub const CODE_INTERNAL: u64 = 999;
/// No code: libcni's `types.Error` as it makes one itself (its zero value), e.g. for a
/// delegated plugin that failed without an error object of its own.
pub const CODE_UNSET: u64 = 0;

/// A CNI error as printed on stdout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    /// Go's `uint` (64 bits): a plugin's own code is passed through whole.
    pub code: u64,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u64, msg: impl Into<String>, details: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: details.into(),
        }
    }

    /// An untyped failure: code 999 with the error's text, as Go's skel does for `error`s.
    pub fn internal(msg: impl Into<String>) -> Self {
        CniError::new(CODE_INTERNAL, msg, "")
    }
}
