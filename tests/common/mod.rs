//! Fixtures shared by the end-to-end suites.
pub mod cluster;
pub mod cni;
pub mod conformance;
pub mod etcd;
pub mod ipam_churn;
pub mod kdd;
pub mod kube_api;
pub mod netns;
pub mod world;
