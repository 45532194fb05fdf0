#!/usr/bin/env bash
# make bench: pod start through a real node first (pod_start.sh: RunPodSandbox and
# StopPodSandbox from containerd's log, ours against ptp+host-local, one pod alone and 20 at
# once; needs the peers `make deps` builds; BENCH_POD=0 leaves it out), then bench.py (ADD/DEL vs
# ptp+host-local interleaved on etcd with and without policy k8s and on the Kubernetes
# datastore, N concurrent ADDs, datastore requests per call, VERSION start-up, peak RSS),
# api_cost.py (the API server's CPU per request of a Kubernetes-datastore ADD),
# ipam_bench.py (allocations/s, empty vs 90 %-full pool) and the dataplane's own calls
# (benches/dataplane.rs, `cargo bench --bench dataplane`; BENCH_DATAPLANE=0 leaves it out).
# Usage: benches/bench.sh path/to/calico [runs]
set -euo pipefail
# The real kube-apiserver harness for the rows with an API server (the e2e test binary, built
# as `make test` builds it; see real_k8s_harness::serve_for_bench), on the peers `make deps`
# builds (kube-apiserver v1.35, kubelet, containerd 2: tools/peers; CALICO_PEERS_BIN overrides
# where they are); without them those rows are left out.
peers_bin=${CALICO_PEERS_BIN:-/var/cache/calico-cni-rs/peers/bin}
if [ -x "$peers_bin/kube-apiserver" ]; then
  if [ "${BENCH_POD:-1}" != 0 ]; then
    bash "$(dirname "$0")/pod_start.sh" "$1" ${BENCH_BEFORE:+"$BENCH_BEFORE"}
  fi
  # The end-to-end test binary (its real_k8s_harness::serve_for_bench), from cargo's JSON
  # messages (wherever CARGO_TARGET_DIR is).
  harness=$(cargo test --test e2e --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "e2e" and m.get("executable"):
        print(m["executable"])')
  if [ -z "$harness" ]; then
    echo "cargo built no e2e test binary" >&2
    exit 1
  fi
  export BENCH_KUBE_API_BIN="$harness"
else
  echo "bench: no $peers_bin/kube-apiserver (make deps builds it): the rows with an API server are left out" >&2
fi
python3 "$(dirname "$0")/bench.py" "$@"
# What each API request of a Kubernetes-datastore ADD costs the API server (CPU, per request).
if [ -n "${BENCH_KUBE_API_BIN:-}" ]; then
  python3 "$(dirname "$0")/api_cost.py" "$1"
fi
python3 "$(dirname "$0")/ipam_bench.py" "$1"
# The Linux dataplane's build and finish (as ADD runs them) and clean_up_namespace against the
# kernel, no plugin process around them.
if [ "${BENCH_DATAPLANE:-1}" != 0 ]; then
  cargo bench --bench dataplane
fi
