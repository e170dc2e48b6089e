#!/usr/bin/python3
"""Token files for the command-line and MPI tests of tokens:PATH, written as llm.c's
dev/data/data_common.py write_datafile writes shards (a 256 x int32 header: magic,
version, token count; then uint16 or uint32 ids).  Usage: make_shards.py DIR"""
import os
import random
import struct
import sys

GPT2 = (20240520, 1, "<H")
LLAMA3 = (20240801, 7, "<I")


def shard(path, ids, kind=GPT2, count=None, magic=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    header = [0] * 256
    header[0], header[1], header[2] = magic or kind[0], kind[1], len(ids) if count is None else count
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(b"".join(struct.pack(kind[2], i) for i in ids))


def main(out):
    rng = random.Random(7)
    # A corpus of documents (ids 1 .. 63, end-of-text 0) in three shards, and the same
    # tokens as a flat uint16 file and as one shard.
    def documents(n):
        ids = []
        while len(ids) < n:
            ids += [rng.randrange(1, 64) for _ in range(rng.randrange(5, 60))] + [0]
        return ids

    stream = documents(6000)
    for i, part in enumerate((stream[:2500], stream[2500:4000], stream[4000:])):
        shard(f"{out}/good/train_{i:03d}.bin", part)
    shard(f"{out}/one/all.bin", stream)
    with open(f"{out}/flat.bin", "wb") as f:
        f.write(b"".join(struct.pack("<H", i) for i in stream))
    shard(f"{out}/val.bin", documents(2000)[:2000])
    shard(f"{out}/llama/train_000.bin", [rng.randrange(1, 64) for _ in range(3000)], LLAMA3)
    # Bad input.
    shard(f"{out}/bad_magic/x.bin", stream[:500], magic=12345)
    shard(f"{out}/past.bin", stream[:500], count=600)
    shard(f"{out}/vocab.bin", [60000] * 500)
    with open(f"{out}/truncated.bin", "wb") as f:
        f.write(struct.pack("<3i", *GPT2[:2], 500))


if __name__ == "__main__":
    main(sys.argv[1])
