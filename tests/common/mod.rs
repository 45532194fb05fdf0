//! Fixtures shared by the end-to-end suites.
pub mod apt;
pub mod cluster;
pub mod cni;
pub mod conformance;
pub mod etcd;
pub mod examples;
pub mod grpc_dataplane;
pub mod image;
pub mod installer;
pub mod ipam_churn;
pub mod kdd;
pub mod kube_api;
pub mod libcni;
pub mod netns;
pub mod real_k8s;
pub mod real_node;
pub mod world;
