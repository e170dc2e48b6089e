#!/usr/bin/python3
"""`mpipe generate` of the Llama family against PyTorch: a tiny llama is trained, and its
greedy text (temperature 0) equals, token for token, the reference twin's greedy loop
with a key/value cache (scripts/mpipe_torch.py's Llama.generate_greedy: rotated keys
cached, grouped-query attention), the twin's weights read from the checkpoint with h5py
under mpipe's own names; past the model's context (where both keep the last half and run
it again from position 0), from a short prompt, one token and a prompt longer than the
context. Two models: grouped-query attention (2 key/value heads of 4) with its own head,
and multi-query attention (1) with the head tied to the token table in 3 vocabulary
chunks and RoPE's Llama 3 base. Split over 2 ranks, greedy text is the twin's too, and
sampled text (temperature, top-k, top-p, several samples) is the one rank's byte for
byte. Exits non-zero on any mismatch.
"""
import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "scripts"))
from check_export import check, failures, keyed, train  # noqa: E402
from check_generate import generate, ids  # noqa: E402
from mpipe_torch import Llama  # noqa: E402

torch.set_num_threads(1)


def llama_from_checkpoint(name, path, L, C, H, T, V, **options):
    """The twin with a checkpoint's weights, every one of its parameters named in the file."""
    model = Llama(L, C, H, T, V, **options)
    weights = keyed(path)
    params = model.named()
    only_file, only_twin = sorted(set(weights) - set(params)), sorted(set(params) - set(weights))
    check(not only_file and not only_twin,
          f"{name}: the twin's parameter names are the checkpoint's (file only {only_file}, twin only {only_twin})")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(torch.from_numpy(weights[key]))
    return model.eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpipe", required=True)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="mpipe-generate-llama-")
    try:
        L, C, H, T, V, F = 2, 32, 4, 16, 64, 48
        base = ["--model", "llama", "--layers", str(L), "--d-model", str(C), "--heads", str(H), "--seq-len", str(T),
                "--vocab", str(V), "--ffn", str(F), "--batch-size", "16", "--micro-batches", "2", "--lr", "0.01"]
        models = [
            ("gqa", ["--kv-heads", "2", "--tie-embeddings", "off"], {"kv_heads": 2, "ffn": F, "tie": False}),
            ("mqa-tied-chunks", ["--kv-heads", "1", "--tie-embeddings", "on", "--head-chunks", "3", "--rope-theta", "500000"],
             {"kv_heads": 1, "ffn": F, "tie": True, "rope_theta": 500000.0}),
        ]
        prompt = [5, 17, 3, 60, 2, 9, 33]
        longer = [int(t) for t in np.random.default_rng(3).integers(0, V, T + 5)]
        n = 3 * T  # past the context twice: the window slides
        for name, args, options in models:
            run_dir, ckpt = train(a.mpipe, work, name, [*base, *args], 100)
            twin = llama_from_checkpoint(name, ckpt, L, C, H, T, V, **options)

            # ---- greedy against the twin's KV-cache loop, on 1 rank (and 2) ----
            for i, tokens in enumerate([prompt, [1], longer]):
                path = os.path.join(work, f"{name}-prompt{i}.bin")
                np.array(tokens, dtype="<u2").tofile(path)
                want = twin.generate_greedy(tokens, n)
                for ranks in ((0, 2) if i == 0 else (0,)):
                    code, stdout, err = generate(a.mpipe, ["--checkpoint", run_dir, "--prompt-tokens", path, "--tokens", str(n),
                                                           "--temperature", "0"], ranks=ranks)
                    got = ids(stdout) if code == 0 else []
                    first = next((j for j, (x, y) in enumerate(zip(got[len(tokens):], want)) if x != y), None)
                    ok = code == 0 and got[:len(tokens)] == tokens and got[len(tokens):] == want and len(set(want)) >= 3
                    check(ok, f"{name}: greedy from a prompt of {len(tokens)}, {n} tokens past a context of {T}"
                              f"{f' on {ranks} ranks' if ranks else ''}: mpipe equals PyTorch's KV-cache loop token for token"
                              f" (exit {code}; first difference at {first}; {len(set(want))} distinct tokens)"
                              f"{'' if ok else ' ' + err.strip()[-200:]}")

            # ---- sampling: 1 rank and 2 ranks, byte for byte ----
            sampled = ["--checkpoint", ckpt, "--prompt-tokens", os.path.join(work, f"{name}-prompt0.bin"), "--tokens", str(n),
                       "--samples", "3", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "11"]
            code1, one, err1 = generate(a.mpipe, sampled, ranks=1)
            ok = code1 == 0 and one.count(b"== sample") == 3 and len(set(one.split(b"== sample")[1:])) == 3
            check(ok, f"{name}: 3 different samples on 1 rank (exit {code1}){'' if ok else ' ' + err1.strip()[-200:]}")
            code2, two, err2 = generate(a.mpipe, sampled, ranks=2)
            ok = code2 == 0 and two == one
            check(ok, f"{name}: sampled on 2 ranks, the one rank's text byte for byte (exit {code2})"
                      f"{'' if ok else ' ' + err2.strip()[-200:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
