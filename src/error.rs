//! The crate's top-level error: one variant per layer, mapped once to a CNI error code.

use crate::config::ConfigError;
use crate::dataplane::DataplaneError;
use crate::datastore::DatastoreError;
use crate::identifiers::IdentifierError;
use crate::ipam::allocator::IpamError;
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

/// The one place errors become CNI codes: typed CNI errors keep theirs, everything else is
/// 999 ("internal") with the error's text, as Go's skel does for untyped errors.
impl From<Error> for CniError {
    fn from(e: Error) -> CniError {
        match e {
            Error::Cni(c) => c,
            other => CniError::internal(other.to_string()),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
