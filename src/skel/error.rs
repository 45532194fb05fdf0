//! The CNI error object (`{"code","msg","details"}`) and the spec's well-known codes.

/// CNI spec error codes used by the skel.
pub const CODE_INCOMPATIBLE_VERSION: u32 = 1;
pub const CODE_UNSUPPORTED_FIELD: u32 = 2;
pub const CODE_UNKNOWN_CONTAINER: u32 = 3;
pub const CODE_INVALID_ENV: u32 = 4;
pub const CODE_IO_FAILURE: u32 = 5;
pub const CODE_DECODING_FAILURE: u32 = 6;
pub const CODE_INVALID_NETWORK_CONFIG: u32 = 7;
pub const CODE_INVALID_NETNS: u32 = 8;
pub const CODE_TRY_AGAIN_LATER: u32 = 11;
pub const CODE_NOT_AVAILABLE: u32 = 50;
pub const CODE_LIMITED_CONNECTIVITY: u32 = 51;
pub const CODE_INTERNAL: u32 = 999;

/// A CNI error as printed on stdout.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{msg}")]
pub struct CniError {
    pub code: u32,
    pub msg: String,
    pub details: String,
}

impl CniError {
    pub fn new(code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
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
