//! Links the `calico` binary as a position-dependent executable (`-no-pie`), as Go links
//! upstream's plugins. A position-independent one makes the dynamic loader apply ~18,000
//! relocations at every start, writing (and so copying) ~90 pages of `.data.rel.ro`: about a
//! fifth of a VERSION call's time and 80 of its 177 page faults (BENCHMARKS.md). The cost is
//! the executable's own load-address randomisation (libraries, heap and stacks keep theirs).
//! Set `CALICO_PIE=1` to build a position-independent binary instead.
//!
//! It also generates the gRPC dataplane's protocol code (`src/dataplane/grpc/cnibackend.proto`,
//! with `protoc`, which etcd-client's build already needs) twice: messages and client for the
//! library (`$OUT_DIR/grpc-client`), messages and server for the tests' fake dataplane
//! (`$OUT_DIR/grpc-server`), so the shipped binary carries no server code.

use std::path::PathBuf;

const PROTO: &str = "src/dataplane/grpc/cnibackend.proto";

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CALICO_PIE");
    // glibc only: the static musl build is made position-dependent by its target's
    // `-C relocation-model=static` (.cargo/config.toml); `-no-pie` on top of musl's default
    // static-pie code makes a binary that crashes at start.
    let linux = std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux")
        && std::env::var("CARGO_CFG_TARGET_ENV").is_ok_and(|env| env == "gnu");
    let pie = std::env::var("CALICO_PIE").is_ok_and(|v| v == "1");
    if linux && !pie {
        println!("cargo:rustc-link-arg-bins=-no-pie");
    }
    generate_grpc();
}

fn generate_grpc() {
    println!("cargo:rerun-if-changed={PROTO}");
    let Some(out) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        panic!("OUT_DIR is not set (not run by cargo?)");
    };
    for (dir, client) in [("grpc-client", true), ("grpc-server", false)] {
        let dir = out.join(dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            panic!("cannot create {}: {e}", dir.display());
        }
        let built = tonic_prost_build::configure()
            .build_client(client)
            .build_server(!client)
            .build_transport(false)
            .out_dir(&dir)
            .compile_protos(&[PROTO], &["src/dataplane/grpc"]);
        if let Err(e) = built {
            panic!("cannot generate the gRPC dataplane code from {PROTO}: {e}");
        }
    }
}
