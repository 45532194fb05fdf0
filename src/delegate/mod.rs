//! Another CNI plugin run from CNI_PATH, as libcni's `invoke` package runs it: finding and
//! executing it (`exec`), its failure as libcni reports it (`plugin_error`), and the state
//! azure-vnet-ipam needs on disk (`azure`).

pub mod azure;
pub mod exec;
pub mod plugin_error;

use std::path::PathBuf;

use crate::skel::CniError;
use crate::support::deadline::Expired;
use crate::support::gojson::GoJsonError;

pub use azure::AzureError;
pub use exec::{FindError, HostLocalConfError};
pub use plugin_error::PluginError;

/// Why running a delegated plugin did not give a result, each cause with its type.
#[derive(Debug, thiserror::Error)]
pub enum DelegateError {
    /// The plugin failed or could not be started, as libcni reports it (`plugin_error`).
    #[error(transparent)]
    Plugin(Box<PluginError>),
    /// It is not in CNI_PATH (libcni's `FindInPath`).
    #[error(transparent)]
    Find(#[from] FindError),
    /// azure-vnet-ipam's state on disk.
    #[error(transparent)]
    Azure(#[from] AzureError),
    /// host-local's `usePodCidr` subnets could not be rewritten.
    #[error(transparent)]
    HostLocalConf(#[from] HostLocalConfError),
    /// The call's deadline passed while the plugin was started or awaited.
    #[error(transparent)]
    Deadline(#[from] Expired),
    /// Feeding the plugin its stdin, or waiting for it, failed.
    #[error("{what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Its output is not a JSON object (libcni's words).
    #[error("failed to unmarshal raw result: {0}")]
    RawResult(GoJsonError),
    /// Its result names a CNI version libcni does not know (Go-quoted).
    #[error("unsupported CNI result version {0}")]
    ResultVersion(String),
    /// Its result does not decode in its version: the CNI error the decoder gives.
    #[error("{}", .0.msg)]
    Result(CniError),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

impl From<PluginError> for DelegateError {
    fn from(e: PluginError) -> Self {
        DelegateError::Plugin(Box::new(e))
    }
}

pub type Result<T, E = DelegateError> = std::result::Result<T, E>;
