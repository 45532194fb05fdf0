//! The end-to-end suites, as one integration-test crate: the shared fixtures
//! (`tests/common`) are compiled once, not once per suite. Each suite is a module named as
//! its file (`tests/e2e/<suite>.rs`), so `cargo test --test e2e <suite>::` runs one suite and
//! `cargo test --test e2e <suite>::<test>` one test. What the suites share in this one
//! process (the netns, temp dir and etcd counters, libcni's driver, the host a real node
//! runs on) is in docs/tests.md.

// Test code: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../common/mod.rs"]
mod common;

mod add_overlap;
mod azure_ipam;
mod calico_etcd;
mod calico_kdd;
mod cli;
mod cni_1_1;
mod conf_examples;
mod critest;
mod dataplane;
mod datastore_conformance;
mod datastore_env;
mod datastore_etcd;
mod deadline;
mod delegated_ipam;
mod differential;
mod grpc_dataplane;
mod hangs_and_leaks;
mod http_proxy;
mod image;
mod install;
mod ipam_concurrency;
mod ipam_datastore;
mod ipam_upgrade;
mod kdd_concurrency;
mod kdd_frozen_api_server;
mod kdd_rate_limit;
mod kube_api_server;
mod kubevirt;
mod libcni_clients;
mod log_rotation;
mod module_graph;
mod node_installer;
mod podman_cni;
mod real_k8s_harness;
mod real_k8s_install;
mod real_node;
mod same_sandbox_add;
mod shared_scenarios;
mod upstream_check;
mod upstream_parity;
