# calico-cni-rs: build, test, install, demo, bench.
# `make test` installs what it needs (Debian packages) and runs everything CI runs.

SHELL := /bin/bash
# `make install` layout: $(DESTDIR)$(PREFIX)/calico, the calico-ipam symlink next to it, and
# $(DESTDIR)$(CONF_DIR)/<example>.example (an inert copy: runtimes only load *.conf,
# *.conflist and *.json, so a node's own conflist is never replaced or shadowed).
DESTDIR ?=
PREFIX ?= /opt/cni/bin
CONF_DIR ?= /etc/cni/net.d
CONF_EXAMPLE ?= conf-examples/10-calico-kubernetes.conflist
# The binary to install; the default is built with `cargo build --release`. Any other path
# (e.g. BIN=target/debug/calico) is installed as it is.
BIN ?= target/release/calico
# Debian packages for the build and the tests: etcd, protoc, the reference CNI plugins
# (portmap, bandwidth, host-local), iptables for portmap, GNU time for the bench's peak RSS,
# Go + libcni for the libcni driver (tests/libcni), podman + runc + a static busybox for the
# podman test; buildah, musl-tools and file for `make image` (the static binary and its check);
# the arm64 half of the image: Debian's aarch64 cross gcc and its libc headers (the linker, and
# the C compiler of ring, against Rust's own musl) and qemu-user-static (tests/e2e/image.rs
# runs the arm64 binaries under qemu-aarch64-static);
# containerd (+ runc, busybox-static) for the image import and the real node suite
# (tests/e2e/real_node.rs: kubelet -> containerd -> our binary); docker-registry, skopeo and
# curl for critest (tests/e2e/critest.rs: its images served from the node's loopback).
# Then the peers, pinned Go modules built into a cache outside the repository
# (tools/peers/build.sh: Kubernetes v1.35, containerd 2, cri-tools, the reference plugins).
APT_PACKAGES := etcd-server etcd-client protobuf-compiler libprotobuf-dev time \
	containernetworking-plugins iproute2 iputils-ping iptables \
	golang-go golang-github-appc-cni-dev podman runc busybox-static \
	buildah musl-tools file containerd \
	gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static \
	docker-registry skopeo curl
# The static builds of the binary the image ships (amd64 and arm64), in cargo's target dir.
CARGO_OUT := $(or $(CARGO_TARGET_DIR),target)
MUSL_TARGET := x86_64-unknown-linux-musl
STATIC_BIN := $(CARGO_OUT)/$(MUSL_TARGET)/release/calico
ARM64_TARGET := aarch64-unknown-linux-musl
STATIC_BIN_ARM64 := $(CARGO_OUT)/$(ARM64_TARGET)/release/calico

.PHONY: all build release static image deps lint test unit e2e install demo bench clean FORCE upstream-check \
	differential oracle

all: build

build:
	cargo build

release:
	cargo build --release

# The static (musl) binary the image ships: it runs on any x86-64 node, whatever its libc.
static:
	cargo build --release --target $(MUSL_TARGET)

# The calico/cni-compatible OCI image, an index of linux/amd64 and linux/arm64:
# target/image/calico-cni-rs.oci.tar (image/build.sh). The arm64 binary is cross-built with
# Debian's aarch64 gcc as its linker (.cargo/config.toml).
image: deps static
	@rustup target list --installed 2>/dev/null | grep -qx $(ARM64_TARGET) || rustup target add $(ARM64_TARGET)
	cargo build --release --target $(ARM64_TARGET)
	bash image/build.sh $(STATIC_BIN) $(STATIC_BIN_ARM64) target/image

# Install the Debian packages the build and the tests need, only when one is missing.
deps:
	@missing=""; for p in $(APT_PACKAGES) $(EXTRA_APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@command -v cargo >/dev/null || { echo "cargo (Rust toolchain) is required"; exit 1; }
	@rustup target list --installed 2>/dev/null | grep -qx $(MUSL_TARGET) || rustup target add $(MUSL_TARGET)
	@command -v go >/dev/null || { echo "go (1.26) is required for the peers (tools/peers)"; exit 1; }
	bash tools/peers/build.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings

# Unit tests and end-to-end suites (root: they create network namespaces). The suites are one
# test binary, e2e (tests/e2e): `cargo test --test e2e <suite>::` runs one (docs/tests.md).
test: deps lint image
	cargo test --all-targets -- --test-threads=2

unit:
	cargo test --lib

# The differential suite against upstream Calico v3.32.1's own binaries (docs/differences.md):
# CALICO_UPSTREAM_BIN names the folder holding upstream's `calico`, built from its source
# outside this repository; nothing of it is in the repository.
# `make differential`: every case of the corpus (tests/e2e/differential/corpus.rs), mixed
# sequences too, run by both; one line per differing case, then the totals per datastore.
# `make oracle` (CALICO_UPSTREAM_COMMIT: the commit those binaries were built from): records
# upstream's outcome of every single-binary case into tests/differential/recorded.jsonl,
# which `make test` replays against ours. CALICO_DIFFERENTIAL_CASES=<patterns> runs a part.
differential: deps
	cargo test --test e2e differential::live_against_upstream -- --ignored --nocapture

oracle: deps
	cargo test --test e2e differential::record_the_oracle -- --ignored --nocapture

# Calico v3.32.1's own components acting on what ours writes, each test with upstream's plugin
# as the control (tests/e2e/upstream_check, docs/swap-in.md): CALICO_UPSTREAM_BIN names the
# folder of upstream's calico, calicoctl and calico-felix, built from its source outside this
# repository. Never part of `make test`. Felix execs ipset, nft and conntrack; the two-node
# rolling swap runs our image's install (`make image`). Then the real-cluster suites (churn,
# kills mid-ADD, a frozen API server, kubelet + containerd), each ending with upstream's
# `calicoctl ipam check` finding no problem.
upstream-check:
	$(MAKE) deps EXTRA_APT_PACKAGES="ipset nftables conntrack"
	$(MAKE) image
	cargo test --test e2e upstream_check:: -- --ignored --nocapture --test-threads=1
	cargo test --test e2e -- --test-threads=1 kdd_concurrency:: kdd_frozen_api_server:: \
	  calico_kdd:: kubevirt:: real_node::

install: $(BIN)
	install -d $(DESTDIR)$(PREFIX) $(DESTDIR)$(CONF_DIR)
	install -m 0755 $(BIN) $(DESTDIR)$(PREFIX)/calico
	ln -sfn calico $(DESTDIR)$(PREFIX)/calico-ipam
	install -m 0644 $(CONF_EXAMPLE) $(DESTDIR)$(CONF_DIR)/$(notdir $(CONF_EXAMPLE)).example

target/release/calico: FORCE
	cargo build --release

FORCE:

# Build, start a throwaway etcd, ADD two pods in two netns, ping, show keys, DEL.
demo: deps release
	bash tests/scripts/demo.sh target/release/calico

# ADD/DEL latency against Debian's ptp+host-local, VERSION start-up time, peak RSS.
# The static (musl) build the image ships runs in the same rotation (BENCH_BEFORE), unless
# BENCH_BEFORE names another binary.
bench: deps release static
	BENCH_BEFORE=$${BENCH_BEFORE:-$(STATIC_BIN)} BENCH_BEFORE_LABEL=$${BENCH_BEFORE_LABEL:-static-musl} \
	  bash benches/bench.sh target/release/calico

clean:
	cargo clean
