#!/usr/bin/env bash
# Installs mpipe's system dependencies on Debian 12 with apt-get. Idempotent and quiet
# when everything is present. Usage: scripts/setup.sh [--test]
#   (no flag)  what building and running needs
#   --test     also what the tests and plots need (PyTorch, h5py, numpy, matplotlib,
#              and Slurm with munge for the tests that start a real cluster)
set -euo pipefail

build_pkgs=(build-essential cmake ninja-build pkg-config git
            openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools
            libcli11-dev libtomlplusplus-dev nlohmann-json3-dev doctest-dev libopenblas-openmp-dev libopenblas0-openmp zlib1g-dev
            libsentencepiece-dev libpcre2-dev  # tokenizers: SentencePiece models, BPE's split regex
            sentencepiece)  # spm_train, for scripts/train_tokenizer.sh
test_pkgs=(python3 python3-torch python3-torchvision python3-h5py python3-numpy python3-matplotlib python3-sklearn
           python3-sentencepiece python3-regex  # the Python twins of tokenizer tests
           slurmctld slurmd slurm-client munge
           iproute2 util-linux bc)  # multinode: network namespaces, unshare/taskset, timings

want=("${build_pkgs[@]}")
[[ "${1:-}" == "--test" ]] && want+=("${test_pkgs[@]}")

missing=()
for pkg in "${want[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$pkg")
done
((${#missing[@]} == 0)) && exit 0

if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else
    echo "setup.sh: missing packages (${missing[*]}) and not root; hint: run as root or install them" >&2
    exit 2
  fi
else
  SUDO=
fi
echo "setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
