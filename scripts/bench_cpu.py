#!/usr/bin/python3
"""PyTorch side of scripts/bench_cpu.sh: median training-step time of the same model
mpipe trains (scripts/mpipe_torch.py), with the same sizes, micro-batches, optimizer
and thread count. Prints the median step time in seconds and, with --memory, the peak
bytes PyTorch's CPU allocator held for one step's activations (parameters, gradients
and optimizer state left out, as mpipe's activation peak)."""
import argparse
import ctypes
import os
import statistics
import sys
import time
import tomllib

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mpipe_torch import GPT, MLP, Llama, Sequential  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="gpt, llama, mlp or a model file (TOML)")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: as --heads)")
    ap.add_argument("--ffn", type=int, default=0, help="llama: the SwiGLU width (0: Llama's rule)")
    ap.add_argument("--tie-embeddings", default="off", help="llama: on or off")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inputs", type=int, default=1024)
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--micro-batches", type=int, default=1)
    ap.add_argument("--memory", action="store_true", help="also print the activation peak in bytes")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model == "gpt":
        model = GPT(a.layers, a.d_model, a.heads, a.seq_len, a.vocab)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        x = torch.randint(0, a.vocab, (a.batch_size, a.seq_len))
        y = torch.randint(0, a.vocab, (a.batch_size, a.seq_len))
    elif a.model == "llama":
        model = Llama(a.layers, a.d_model, a.heads, a.seq_len, a.vocab, kv_heads=a.kv_heads, ffn=a.ffn,
                      tie=a.tie_embeddings == "on")
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:  # the norms stay 1, as mpipe's
                    p.normal_(0, 0.02)
        x = torch.randint(0, a.vocab, (a.batch_size, a.seq_len))
        y = torch.randint(0, a.vocab, (a.batch_size, a.seq_len))
    elif a.model.endswith(".toml"):
        with open(a.model, "rb") as f:
            spec = tomllib.load(f)
        model = Sequential(spec, a.micro_batches)  # the micro-batches run inside its forward
        classes = next(layer["out"] for layer in reversed(spec["layer"]) if layer["kind"] == "linear")
        x = torch.randn(a.batch_size, *spec["input"])
        y = torch.randint(0, classes, (a.batch_size,))
        a.micro_batches = 1
    else:
        model = MLP(a.layers, a.hidden, a.inputs, a.classes)
        x = torch.randn(a.batch_size, a.inputs)
        y = torch.randint(0, a.classes, (a.batch_size,))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    micro = a.batch_size // a.micro_batches
    heap = ctypes.CDLL(None) if a.memory else None  # scripts/heap_peak.c, preloaded
    if heap:
        heap.heap_peak.restype = heap.heap_peak_reset.restype = ctypes.c_long
    times, peaks = [], []
    for step in range(a.steps):
        if heap:
            before = heap.heap_peak_reset()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        for m in range(a.micro_batches):
            loss = model(x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro]) / a.micro_batches
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(time.perf_counter() - start)
        if heap:
            peaks.append(heap.heap_peak() - before)  # the step's activations and temporaries
    print(f"{statistics.median(times[3:]):.6f}" + (f" {max(peaks[3:])}" if heap else ""))


if __name__ == "__main__":
    main()
