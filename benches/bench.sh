#!/usr/bin/env bash
# make bench: bench.py (ADD/DEL vs ptp+host-local interleaved, N concurrent ADDs, datastore
# requests per call, VERSION start-up, peak RSS) and ipam_bench.py (allocations/s, empty vs
# 90 %-full pool). Usage: benches/bench.sh path/to/calico [runs]
set -euo pipefail
# The test API server for the Kubernetes-datastore rows (a test binary, built as `make test`
# builds it; see serve_for_bench). Not a real kube-apiserver: compare the rows within a run.
kube_api=$(cargo test --test kube_api_server --no-run 2>&1 | grep -o 'target/debug/deps/kube_api_server-[0-9a-f]*' | head -1)
BENCH_KUBE_API_BIN="$(realpath "$kube_api")" python3 "$(dirname "$0")/bench.py" "$@"
python3 "$(dirname "$0")/ipam_bench.py" "$1"
