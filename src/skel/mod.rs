//! The CNI protocol, knowing nothing of Calico: reads CNI_* env and stdin, validates them
//! exactly as Go's libcni `pkg/skel` (v1.3) does, negotiates the version, calls the plugin and
//! prints the result or the error JSON. See anchors.md §3.3.

pub mod args;
pub mod error;
pub mod result;
pub mod version;

pub use error::CniError;
pub use result::CniResult;

/// What a plugin receives for one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CmdArgs {
    pub container_id: String,
    pub netns: String,
    pub ifname: String,
    /// Raw CNI_ARGS (`K=V;K=V`).
    pub args: String,
    /// CNI_PATH (colon-separated).
    pub path: String,
    pub netns_override: String,
    /// The network configuration from stdin, raw.
    pub stdin_data: Vec<u8>,
}

/// A CNI plugin. `add` returns the result in the spec-1.0 model; skel encodes it in the
/// config's `cniVersion`.
pub trait Plugin {
    /// Printed on stderr when CNI_COMMAND is not set at all.
    fn about(&self) -> String;
    /// The version used to print results when the config has no `cniVersion`
    /// (`calico` uses "0.2.0", `calico-ipam` "0.1.0").
    fn default_result_version(&self) -> &'static str;
    fn add(&self, args: &CmdArgs) -> Result<CniResult, CniError>;
    fn del(&self, args: &CmdArgs) -> Result<(), CniError>;
    fn check(&self, args: &CmdArgs) -> Result<(), CniError>;
}
