#!/usr/bin/env bash
# make bench: see bench.py. Usage: benches/bench.sh path/to/calico [runs]
set -euo pipefail
exec python3 "$(dirname "$0")/bench.py" "$@"
