#!/usr/bin/python3
"""Reading an mpipe checkpoint with h5py: the attributes, every tensor keyed by
(global layer, parameter name), the optimizer state, and a checksum check.

    /usr/bin/python3 scripts/inspect_checkpoint.py checkpoints/ckpt-00001000.h5
"""
import sys
import zlib

import h5py
import numpy as np


def main(path):
    with h5py.File(path, "r") as f:
        for key in ("format", "format_version", "mpipe_version", "model_signature", "optimizer"):
            value = f.attrs[key]
            print(f"{key:16} {value.decode() if isinstance(value, bytes) else value}")
        train = f["train"].attrs
        print(f"{'step':16} {train['step']}  (optimizer updates {train['optimizer_updates']})")
        total = 0
        for layer in sorted(f["model"]):
            for name, dset in sorted(f["model"][layer].items()):
                values = dset[()]
                total += values.size
                # Each dataset's CRC-32 over its little-endian float32 bytes.
                ok = zlib.crc32(values.astype("<f4").tobytes()) == int(dset.attrs["crc32"])
                print(f"layer {int(layer):3d} {name:28} {str(values.shape):14} norm {np.linalg.norm(values):10.4f}"
                      f" crc {'ok' if ok else 'BAD'}")
        print(f"parameters: {total}")
        for state in f["optimizer"]:
            print(f"optimizer state '{state}': {len(f['optimizer'][state])} layers")
        print("config:\n" + (f.attrs["config"].decode() if isinstance(f.attrs["config"], bytes) else f.attrs["config"]))


if __name__ == "__main__":
    main(sys.argv[1])
