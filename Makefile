# calico-cni-rs: build, test, install, demo, bench.
# `make test` installs what it needs (Debian packages) and runs everything CI runs.

SHELL := /bin/bash
PREFIX ?= /opt/cni/bin
CONF_DIR ?= /etc/cni/net.d
APT_PACKAGES := etcd-server etcd-client protobuf-compiler libprotobuf-dev \
	containernetworking-plugins iproute2 iputils-ping

.PHONY: all build release deps lint test unit e2e install demo bench clean

all: build

build:
	cargo build

release:
	cargo build --release

# Install the Debian packages the build and the tests need, only when one is missing.
deps:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi
	@command -v cargo >/dev/null || { echo "cargo (Rust toolchain) is required"; exit 1; }

lint:
	cargo fmt --all -- --check
	cargo clippy --all-targets -- -D warnings

# Unit tests and end-to-end suites (root: they create network namespaces).
test: deps lint
	cargo test --all-targets -- --test-threads=2

unit:
	cargo test --lib

install: release
	install -d $(PREFIX) $(CONF_DIR)
	install -m 0755 target/release/calico $(PREFIX)/calico
	ln -sf calico $(PREFIX)/calico-ipam

# Build, start a throwaway etcd, ADD two pods in two netns, ping, show keys, DEL.
demo: deps release
	bash tests/scripts/demo.sh target/release/calico

# ADD/DEL latency against Debian's ptp+host-local, VERSION start-up time, peak RSS.
bench: deps release
	bash benches/bench.sh target/release/calico

clean:
	cargo clean
