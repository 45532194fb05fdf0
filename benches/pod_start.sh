#!/usr/bin/env bash
# Pod start through a real node (kubelet + containerd + kube-apiserver): tests/e2e/real_node.rs's
# ignored bench_pod_start, ptp vs our calico (etcd and Kubernetes datastores), interleaved.
# Usage: benches/pod_start.sh path/to/calico [path/to/before-calico]
# Environment: BENCH_POD_ROUNDS (8), BENCH_POD_WAVE (20), BENCH_POD_ALONE (3), BENCH_POD_OUT (report file),
# BENCH_POD_PLUGIN_TIMES=1 (a profile: the network plugin's own ADD/DEL time, through a timing wrapper),
# BENCH_POD_JSON (raw numbers), BENCH_POD_AUDIT (a copy of the API server's audit log),
# BENCH_POD_NEIGHBOUR_MS (100; 0: none: a neighbour's request period on the plugin's APF level),
# BENCH_POD_NEIGHBOUR_AB=1 (every config also without the neighbour, as <config>-quiet),
# BENCH_POD_CONFIGS (a comma list of rows, e.g. calico-etcd,before-etcd; ptp always),
# BENCH_BEFORE_LABEL (the second build's rows' name, default before: "control" when it is this build),
# CALICO_UPSTREAM_BIN (the folder of upstream Calico's binaries: its calico as rows upstream-etcd and upstream-kdd; unset: not measured). Runs as root; needs the peers `make deps` builds (kubelet v1.35, containerd 2; CALICO_PEERS_BIN).
# Several runs' BENCH_POD_JSON files combine with benches/pod_start_pool.py.
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 path/to/calico [path/to/before-calico]" >&2
  exit 2
fi
calico=$(realpath "$1")
before=""
if [ $# -eq 2 ]; then
  before=$(realpath "$2")
fi
cd "$(dirname "$0")/.."
# The end-to-end test binary's path, from cargo's JSON messages (wherever CARGO_TARGET_DIR is).
bin=$(cargo test --test e2e --no-run --message-format=json |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "e2e" and m.get("executable"):
        print(m["executable"])')
if [ -z "$bin" ]; then
  echo "cargo built no e2e test binary" >&2
  exit 1
fi
REAL_NODE_CALICO="$calico" BENCH_BEFORE="$before" \
  "$bin" --ignored --exact real_node::bench_pod_start --nocapture --test-threads=1
