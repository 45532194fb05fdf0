//! Fixtures shared by the end-to-end suites.
pub mod cni;
pub mod conformance;
pub mod etcd;
pub mod netns;
pub mod world;
