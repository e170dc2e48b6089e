#!/usr/bin/env bash
# Installs what running needs, builds mpipe, and runs the default training job
# (inputs/quickstart.toml) on all cores. Extra arguments go to `mpipe train`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target mpipe

exec build/release/mpipe train --config inputs/quickstart.toml "$@"   # --threads 0: all cores
