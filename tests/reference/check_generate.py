#!/usr/bin/python3
"""`mpipe generate` against PyTorch: greedy text (temperature 0) equals, token for token,
a PyTorch greedy loop with a key/value cache (scripts/mpipe_torch.py's
GPT2HF.generate_greedy: Hugging Face GPT-2's layout and use_cache) over the weights
`mpipe export` wrote, past the model's context (where both keep the last half and run it
again); the same for a head in vocabulary chunks, whose weights the twin reads from the
checkpoint. Split over 2 and 3 ranks, sampled text (temperature, top-k, top-p, several
samples) is the one rank's byte for byte; the same seed gives the same text, another
seed another. Bad input gets one line and exit 2. Exits non-zero on any mismatch.
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "scripts"))
from check_export import check, failures, train  # noqa: E402
from mpipe_torch import GPT2HF, read_safetensors  # noqa: E402


def generate(mpipe, args, ranks=0):
    """mpipe generate's exit code, standard output and error (under mpiexec -n ranks when ranks > 0)."""
    launch = ["mpiexec", "-n", str(ranks), "--oversubscribe"] if ranks else []
    r = subprocess.run([*launch, mpipe, "generate", "--threads", "1", *args], capture_output=True, timeout=120)
    return r.returncode, r.stdout, r.stderr.decode(errors="replace")


def hf_from_checkpoint(path, L, C, H, T, V):
    """The twin with a checkpoint's weights, read with h5py (any head: it is the token table)."""
    hf = GPT2HF(L, C, H, T, V)
    with h5py.File(path, "r") as f:
        m = f["model"]
        sd = {"transformer.wte.weight": m["0000/wte"][()], "transformer.wpe.weight": m["0000/wpe"][()],
              "transformer.ln_f.weight": m[f"{L + 1:04d}/weight"][()], "transformer.ln_f.bias": m[f"{L + 1:04d}/bias"][()]}
        for i in range(L):
            def visit(name, obj, i=i):
                if isinstance(obj, h5py.Dataset):
                    value = obj[()]
                    if name.endswith("weight") and value.ndim == 2:
                        value = value.T  # Conv1D's [in, out]
                    sd[f"transformer.h.{i}.{name}"] = value
            m[f"{i + 1:04d}"].visititems(visit)
    hf.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return hf.eval()


def ids(out):
    return [int(t) for t in out.split()]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpipe", required=True)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="mpipe-generate-")
    try:
        L, C, H, T, V = 3, 32, 4, 16, 64
        gpt = ["--model", "gpt", "--layers", str(L), "--d-model", str(C), "--heads", str(H), "--seq-len", str(T),
               "--vocab", str(V), "--batch-size", "16", "--micro-batches", "2", "--lr", "0.01"]
        run_dir, ckpt = train(a.mpipe, work, "gpt", [*gpt, "--checkpoint-every", "50"], 100)
        prompt = [5, 17, 3, 60, 2, 9, 33]
        prompt_file = os.path.join(work, "prompt.bin")
        np.array(prompt, dtype="<u2").tofile(prompt_file)
        n = 3 * T  # past the context twice: the window slides

        # ---- greedy against PyTorch over the exported weights ----
        out = os.path.join(work, "gpt.safetensors")
        r = subprocess.run([a.mpipe, "export", ckpt, out], capture_output=True, text=True)
        check(r.returncode == 0, f"mpipe export: exit {r.returncode} {r.stderr.strip()}")
        tensors, _ = read_safetensors(out)
        hf = GPT2HF(L, C, H, T, V)
        hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
        hf.eval()
        # Three prompts: a short one, one token, and one longer than the context (its last T
        # tokens go in).
        longer = [int(t) for t in np.random.default_rng(3).integers(0, V, T + 5)]
        for i, tokens in enumerate([prompt, [1], longer]):
            path = os.path.join(work, f"prompt{i}.bin")
            np.array(tokens, dtype="<u2").tofile(path)
            want = hf.generate_greedy(tokens, n)
            code, stdout, err = generate(a.mpipe, ["--checkpoint", run_dir, "--prompt-tokens", path, "--tokens", str(n),
                                                   "--temperature", "0"])
            got = ids(stdout) if code == 0 else []
            check(code == 0 and got[:len(tokens)] == tokens, f"greedy: exit {code}, the prompt's ids first {err.strip()[-200:]}")
            first = next((j for j, (x, y) in enumerate(zip(got[len(tokens):], want)) if x != y), None)
            check(got[len(tokens):] == want and len(set(want)) >= 3,
                  f"greedy from a prompt of {len(tokens)}, {n} tokens past a context of {T}: mpipe equals PyTorch's KV-cache"
                  f" loop token for token (first difference at {first}; {len(set(want))} distinct tokens)")

        # ---- a head in vocabulary chunks: the twin from the checkpoint ----
        _, ckpt2 = train(a.mpipe, work, "chunks", [*gpt, "--head-chunks", "3"], 100)
        want2 = hf_from_checkpoint(ckpt2, L, C, H, T, V).generate_greedy(prompt, n)
        code, stdout, err = generate(a.mpipe, ["--checkpoint", ckpt2, "--prompt-tokens", prompt_file, "--tokens", str(n),
                                               "--temperature", "0"])
        check(code == 0 and ids(stdout)[len(prompt):] == want2 and len(set(want2)) >= 3,
              f"greedy, head in 3 vocabulary chunks: mpipe equals PyTorch token for token (exit {code}) {err.strip()[-200:]}")

        # ---- sampling: the ranks, the seed ----
        sampled = ["--checkpoint", ckpt, "--prompt-tokens", prompt_file, "--tokens", str(n), "--samples", "3",
                   "--temperature", "0.9", "--top-k", "20", "--top-p", "0.95", "--seed", "11"]
        code1, one, err1 = generate(a.mpipe, sampled, ranks=1)
        check(code1 == 0 and one.count(b"== sample") == 3, f"3 samples on 1 rank: exit {code1} {err1.strip()[-200:]}")
        for ranks in (2, 3):
            code, out_k, err = generate(a.mpipe, sampled, ranks=ranks)
            check(code == 0 and out_k == one, f"sampled on {ranks} ranks: the one rank's text byte for byte (exit {code})"
                                              f" {err.strip()[-200:]}")
        _, again, _ = generate(a.mpipe, sampled)
        check(again == one, "the same seed, the same text")
        _, other, _ = generate(a.mpipe, [*sampled[:-1], "12"])
        check(other != one, "another seed, another text")
        samples = one.split(b"== sample")[1:]
        check(len(set(samples)) == 3, "the 3 samples differ")

        # ---- a run directory whose newest checkpoint is damaged: the older one, said once ----
        damaged = os.path.join(work, "damaged")
        shutil.copytree(run_dir, damaged)
        newest = os.path.join(damaged, "ckpt-00000100.h5")
        with h5py.File(newest, "r") as f:
            offset = f["model/0000/wte"].id.get_offset()
        with open(newest, "r+b") as f:
            f.seek(offset + 100)
            byte = f.read(1)
            f.seek(offset + 100)
            f.write(bytes([byte[0] ^ 0x40]))
        for ranks in (0, 2):
            code, _, err = generate(a.mpipe, ["--checkpoint", damaged, "--prompt-tokens", prompt_file, "--tokens", "4"], ranks)
            warnings = [line for line in err.splitlines() if "trying an older checkpoint" in line]
            check(code == 0 and len(warnings) == 1 and "ckpt-00000050.h5 (step 50)" in err,
                  f"a damaged newest checkpoint{f' on {ranks} ranks' if ranks else ''}: one warning, the older one used"
                  f" (exit {code}, {len(warnings)} warning(s))")

        # ---- bad input: one line, exit 2 ----
        mlp_dir, _ = train(a.mpipe, work, "mlp", ["--model", "mlp", "--batch-size", "4", "--micro-batches", "2"], 1)
        bad_ids = os.path.join(work, "bad.bin")
        np.array([1, V + 5], dtype="<u2").tofile(bad_ids)
        odd = os.path.join(work, "odd.bin")
        with open(odd, "wb") as f:
            f.write(b"\x01\x00\x02")
        truncated = os.path.join(work, "truncated.h5")
        with open(ckpt, "rb") as f, open(truncated, "wb") as g:
            g.write(f.read(os.path.getsize(ckpt) // 2))
        cases = [
            ("an MLP checkpoint", ["--checkpoint", mlp_dir, "--prompt", "x"], "not a model of tokens"),
            ("an id past the vocabulary", ["--checkpoint", ckpt, "--prompt-tokens", bad_ids], "is not below the vocabulary"),
            ("an odd-sized token file", ["--checkpoint", ckpt, "--prompt-tokens", odd], "whole number of uint16"),
            ("a truncated checkpoint", ["--checkpoint", truncated, "--prompt-tokens", prompt_file], "generate from an older"),
            ("no checkpoint", ["--checkpoint", os.path.join(work, "none.h5")], "no file"),
            ("a 64-token vocabulary as text", ["--checkpoint", ckpt, "--prompt", "hello"], "not below the vocabulary"),
            ("--top-p 0", ["--checkpoint", ckpt, "--prompt-tokens", prompt_file, "--top-p", "0"], "--top-p must be"),
            ("both prompts", ["--checkpoint", ckpt, "--prompt", "a", "--prompt-tokens", prompt_file], "both given"),
            ("--device gpu", ["--checkpoint", ckpt, "--device", "gpu"], "--device must be cpu, cuda or auto"),
        ]
        for ranks in (0, 2):
            for what, args, words in cases:
                code, _, err = generate(a.mpipe, args, ranks=ranks)
                lines = [line for line in err.splitlines() if "error" in line]  # mpiexec adds its own words
                check(code == 2 and len(lines) == 1 and words in err and "hint:" in err,
                      f"{what}{f' on {ranks} ranks' if ranks else ''}: exit {code}, {len(lines)} line(s): {err.strip()[:160]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
