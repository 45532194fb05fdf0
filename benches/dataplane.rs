//! How long the Linux dataplane takes against the real kernel: ADD's `build` then `finish`
//! (tests/common/pod_network.rs) and
//! `clean_up_namespace` called ten times in a row each, one- and two-family, from a thread
//! inside a test "host" netns (with an uplink, like a node; tests/common/netns.rs), each pod
//! in a netns of its own. Root only (it creates network namespaces).
//!
//! `cargo bench --bench dataplane` (as root) prints each call's median, min and max. Under
//! `cargo test` (`make test` builds and runs every target) it runs one round of each as a
//! check that the bench still works, and prints nothing.

// Bench code: a failed unwrap is a failed run.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../tests/common/netns.rs"]
mod netns;

use std::time::{Duration, Instant};

#[path = "../tests/common/pod_network.rs"]
mod pod_network;

use calico_cni::dataplane::clean_up_namespace;
use netns::{HostNetns, Netns};
use pod_network::{network, PodRequest};

/// Calls in a row per family set under `cargo bench`.
const ROUNDS: usize = 10;

fn request(pod: &Netns, host_veth: &str, ips: &[&str], routes: &[&str]) -> PodRequest {
    PodRequest::new(pod.path(), host_veth, ips, routes)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// `median … ms (min …, max …)` of `v` (sorted here).
fn summary(v: &mut [Duration]) -> String {
    v.sort();
    format!(
        "median {:.1} ms (min {:.1}, max {:.1})",
        ms(v[v.len() / 2]),
        ms(v[0]),
        ms(v[v.len() - 1])
    )
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test` runs bench targets without it.
    let measuring = std::env::args().any(|a| a == "--bench");
    let rounds = if measuring { ROUNDS } else { 1 };
    let host = HostNetns::new();
    for (label, ips, routes) in [
        ("ipv4", vec!["10.65.2.1/32"], vec!["0.0.0.0/0"]),
        (
            "dual-stack",
            vec!["10.65.2.1/32", "fd00:65:2::1/128"],
            vec!["0.0.0.0/0", "::/0"],
        ),
    ] {
        let mut add = Vec::new();
        let mut del = Vec::new();
        for _ in 0..rounds {
            let pod = Netns::new("dp-time");
            let req = request(&pod, "calitime", &ips, &routes);
            let t = Instant::now();
            host.run_in(|| network(&req)).unwrap();
            add.push(t.elapsed());
            assert!(pod.has_link("eth0"), "{label}: no pod interface");
            assert!(host.has_link("calitime"), "{label}: no host end");
            let t = Instant::now();
            host.run_in(|| clean_up_namespace(pod.path(), "eth0"))
                .unwrap();
            del.push(t.elapsed());
            assert!(!pod.has_link("eth0"), "{label}: pod interface left");
            assert!(!host.has_link("calitime"), "{label}: host end left");
        }
        if measuring {
            println!(
                "{label}: build and finish {}; clean_up_namespace {} ({rounds} calls each)",
                summary(&mut add),
                summary(&mut del)
            );
        }
    }
}
