#!/usr/bin/env bash
# make bench: bench.py (ADD/DEL vs ptp+host-local, VERSION, RSS) and ipam_bench.py
# (allocations/s, empty vs 90 %-full pool). Usage: benches/bench.sh path/to/calico [runs]
set -euo pipefail
python3 "$(dirname "$0")/bench.py" "$@"
python3 "$(dirname "$0")/ipam_bench.py" "$1"
