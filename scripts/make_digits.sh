#!/usr/bin/env bash
# Writes a real image data set for --data hdf5:PATH, offline: the 1,797 8x8 handwritten
# digits that Debian's python3-sklearn ships (UCI optdigits), split 80/20 in a fixed
# order into OUTDIR/digits-train.h5 (1,438) and OUTDIR/digits-test.h5 (359).
#   scripts/make_digits.sh OUTDIR
# /inputs (N, 1, 8, 8) float32 in [0, 1] (pixel / 16) with attributes mean and std of the
# training split; /labels (N) int32 0-9.
set -euo pipefail
out=${1:?usage: scripts/make_digits.sh OUTDIR}
missing=()
for pkg in python3-sklearn python3-h5py python3-numpy; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  SUDO=$([[ $(id -u) -eq 0 ]] && echo "" || echo sudo)
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
mkdir -p "$out"
/usr/bin/python3 - "$out" <<'PY'
import gzip, os, sys
import h5py, numpy as np
import sklearn
csv = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data", "digits.csv.gz")
with gzip.open(csv, "rt") as f:
    data = np.loadtxt(f, delimiter=",", dtype=np.float64)
x = (data[:, :64] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
y = data[:, 64].astype(np.int32)
order = np.random.RandomState(0).permutation(len(y))
cut = int(round(0.8 * len(y)))
train, test = order[:cut], order[cut:]
mean, std = float(x[train].mean()), float(x[train].std())
for name, rows in (("train", train), ("test", test)):
    path = os.path.join(sys.argv[1], f"digits-{name}.h5")
    with h5py.File(path, "w") as f:
        d = f.create_dataset("inputs", data=x[rows])
        d.attrs["mean"] = np.array([mean], dtype=np.float32)
        d.attrs["std"] = np.array([std], dtype=np.float32)
        f.create_dataset("labels", data=y[rows])
    print(f"{path}: {len(rows)} digits")
PY
