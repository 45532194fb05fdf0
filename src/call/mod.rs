//! How every call of the two plugins starts, above the libraries it uses: the datastore
//! connection its NetConf names (`client`) and the ClusterInformation readiness gate
//! (`cluster_ready`).

pub mod client;
pub mod cluster_ready;
