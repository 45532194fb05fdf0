//! The crate's top-level error: one variant per layer, mapped once to a CNI error code.

use crate::config::ConfigError;
use crate::dataplane::DataplaneError;
use crate::datastore::DatastoreError;
use crate::deadline::{self, Expired};
use crate::identifiers::IdentifierError;
use crate::ipam::allocator::IpamError;
use crate::skel::error::CODE_TRY_AGAIN_LATER;
use crate::skel::CniError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Datastore(#[from] DatastoreError),
    #[error(transparent)]
    Ipam(#[from] IpamError),
    #[error(transparent)]
    Dataplane(#[from] DataplaneError),
    #[error("error constructing WorkloadEndpoint name: {0}")]
    Identifiers(#[from] IdentifierError),
    /// The call's deadline passed (`crate::deadline`).
    #[error(transparent)]
    Deadline(#[from] Expired),
    /// An error that already is a CNI error (e.g. from a delegated IPAM plugin): passed
    /// through unchanged.
    #[error("{}", .0.msg)]
    Cni(CniError),
    #[error("{0}")]
    Msg(String),
}

impl Error {
    pub fn msg(s: impl Into<String>) -> Self {
        Error::Msg(s.into())
    }
}

impl From<CniError> for Error {
    fn from(e: CniError) -> Self {
        Error::Cni(e)
    }
}

/// The one place errors become CNI codes: typed CNI errors keep theirs; a call that ran out
/// of time is code 11, "try again later" (the spec's code for a transient condition the
/// runtime should retry: a datastore that does not answer in time is one), with the deadline
/// as `msg` and the whole error, with its context, as `details`; everything else is 999
/// ("internal") with the error's text, as Go's skel does for untyped errors.
impl From<Error> for CniError {
    fn from(e: Error) -> CniError {
        match e {
            Error::Cni(c) => c,
            Error::Deadline(e) => CniError::new(CODE_TRY_AGAIN_LATER, e.to_string(), ""),
            other => {
                let text = other.to_string();
                // The deadline error is often re-worded on the way up (`error getting
                // ClusterInformation: <it>`): its text is what survives.
                match deadline::cause_in(&text) {
                    Some(expired) => {
                        let msg = expired.to_string();
                        let details = if text == msg { String::new() } else { text };
                        CniError::new(CODE_TRY_AGAIN_LATER, msg, details)
                    }
                    None => CniError::internal(text),
                }
            }
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
