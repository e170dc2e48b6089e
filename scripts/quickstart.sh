#!/usr/bin/env bash
# Installs what running needs, builds mpipe, and runs the default training job
# (inputs/quickstart.toml) as a pipeline over this machine's cores: mpirun, one stage
# per core, one thread per stage. Extra arguments go to `mpipe train`.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
[[ -f build/release/CMakeCache.txt ]] || cmake --preset release >/dev/null
cmake --build --preset release -j "$(nproc)" --target mpipe

# Open MPI refuses to run as root without these (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ranks=$(nproc)
exec mpirun -n "$ranks" --bind-to core build/release/mpipe train --config inputs/quickstart.toml "$@"
