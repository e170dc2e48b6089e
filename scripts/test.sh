#!/usr/bin/env bash
# Installs what is missing (build and test dependencies), builds, and runs every test:
# the release build's whole ctest suite, then the unit tests again under ASan+UBSan (but
# those labelled large: a GPT-2-small step takes 2.5 GiB).
#   MPIPE_TEST_ASAN=0   skip the sanitizer pass
#   MPIPE_TEST_LABEL=L  run only tests labelled L (unit, mpi, reference, slurm, multinode, cuda, faults)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh --test

# Open MPI refuses root without these; CI runs as root.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
jobs=$(nproc)
label=${MPIPE_TEST_LABEL:-}

build() {
  local preset=$1
  [[ -f build/$preset/CMakeCache.txt ]] || cmake --preset "$preset" -DBUILD_TESTING=ON >/dev/null
  cmake --build --preset "$preset" -j "$jobs"
}

echo "== release build"
build release
echo "== tests (release)"
ctest --preset release -j "$jobs" ${label:+-L "$label"}

if [[ "${MPIPE_TEST_ASAN:-1}" != 0 && ( -z "$label" || "$label" == unit ) ]]; then
  echo "== asan build"
  build asan
  echo "== unit tests (ASan + UBSan)"
  ASAN_OPTIONS=abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --preset asan -j "$jobs" -L unit -LE large
fi
