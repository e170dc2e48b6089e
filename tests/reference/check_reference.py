#!/usr/bin/python3
"""The reference test: the same GPT / MLP in PyTorch, against mpipe.

Runs mpipe's reference_dump (initial weights, batches, step-0 gradients, 10 AdamW
steps), rebuilds the model in PyTorch from those weights, and compares the loss and
every gradient (relative error below 1e-4), then the losses of 10 AdamW steps with the
same learning rates. Exits non-zero on any mismatch.
"""
import argparse
import math
import os
import subprocess
import sys

import h5py
import numpy as np
import torch
import torch.nn.functional as F

torch.set_num_threads(2)
TOL = 1e-4


class GPT(torch.nn.Module):
    """GPT-2 as mpipe builds it: layer 0 embedding, 1..N blocks, N+1 final LayerNorm,
    N+2 tied head, N+3 loss; parameters named as in mpipe."""

    def __init__(self, n_layer, C, H, T, V):
        super().__init__()
        self.H = H
        self.wte = torch.nn.Parameter(torch.zeros(V, C))
        self.wpe = torch.nn.Parameter(torch.zeros(T, C))
        self.blocks = torch.nn.ModuleList()
        for _ in range(n_layer):
            b = torch.nn.Module()
            b.ln_1 = torch.nn.LayerNorm(C, eps=1e-5)
            b.c_attn = torch.nn.Linear(C, 3 * C)
            b.c_proj = torch.nn.Linear(C, C)
            b.ln_2 = torch.nn.LayerNorm(C, eps=1e-5)
            b.c_fc = torch.nn.Linear(C, 4 * C)
            b.mlp_proj = torch.nn.Linear(4 * C, C)
            self.blocks.append(b)
        self.ln_f = torch.nn.LayerNorm(C, eps=1e-5)

    def named(self):
        """(global layer, mpipe name) -> torch parameter."""
        n = len(self.blocks)
        out = {(0, "wte"): self.wte, (0, "wpe"): self.wpe}
        for i, b in enumerate(self.blocks):
            for name, p in [("ln_1.weight", b.ln_1.weight), ("ln_1.bias", b.ln_1.bias),
                            ("attn.c_attn.weight", b.c_attn.weight), ("attn.c_attn.bias", b.c_attn.bias),
                            ("attn.c_proj.weight", b.c_proj.weight), ("attn.c_proj.bias", b.c_proj.bias),
                            ("ln_2.weight", b.ln_2.weight), ("ln_2.bias", b.ln_2.bias),
                            ("mlp.c_fc.weight", b.c_fc.weight), ("mlp.c_fc.bias", b.c_fc.bias),
                            ("mlp.c_proj.weight", b.mlp_proj.weight), ("mlp.c_proj.bias", b.mlp_proj.bias)]:
                out[(1 + i, name)] = p
        out[(n + 1, "weight")] = self.ln_f.weight
        out[(n + 1, "bias")] = self.ln_f.bias
        return out

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.wte[idx] + self.wpe[:T]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        for b in self.blocks:
            h = b.ln_1(x)
            q, k, v = b.c_attn(h).split(x.shape[-1], dim=2)
            hs = x.shape[-1] // self.H
            q, k, v = (t.view(B, T, self.H, hs).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
            att = att.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
            x = x + b.c_proj(y)
            x = x + b.mlp_proj(F.gelu(b.c_fc(b.ln_2(x)), approximate="tanh"))
        logits = self.ln_f(x) @ self.wte.t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(torch.nn.Module):
    def __init__(self, n_layer, hidden, inputs, classes):
        super().__init__()
        widths = [inputs] + [hidden] * n_layer
        self.hidden = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:]))
        self.out = torch.nn.Linear(hidden, classes)

    def named(self):
        out = {}
        for i, lin in enumerate(self.hidden):  # Linear at 2i, ReLU at 2i+1
            out[(2 * i, "weight")] = lin.weight
            out[(2 * i, "bias")] = lin.bias
        n = 2 * len(self.hidden)
        out[(n, "weight")] = self.out.weight
        out[(n, "bias")] = self.out.bias
        return out

    def forward(self, x, targets):
        for lin in self.hidden:
            x = F.relu(lin(x))
        return F.cross_entropy(self.out(x), targets.long())


def keyed(group):
    """h5py group /<layer>/<name...> -> {(layer, name): array}."""
    out = {}
    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            layer, _, pname = name.partition("/")
            out[(int(layer), pname)] = obj[()]
    group.visititems(visit)
    return out


def rel(a, b):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dump", required=True)
    ap.add_argument("--model", choices=["gpt", "mlp"], required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    path = os.path.join(args.workdir, f"reference-{args.model}.h5")
    subprocess.run([args.dump, "--model", args.model, "--out", path], check=True)

    f = h5py.File(path, "r")
    n_layer, C, H, T, V, hidden, inputs, classes, batch = (int(v) for v in f["config/sizes"][()])
    beta1, beta2, eps, wd = (float(v) for v in f["config/adamw"][()])
    model = GPT(n_layer, C, H, T, V) if args.model == "gpt" else MLP(n_layer, hidden, inputs, classes)
    params = model.named()
    init, grads, final = keyed(f["params"]), keyed(f["grads"]), keyed(f["final"])
    decay = {k: int(v[0]) for k, v in keyed(f["decay"]).items()}
    failures = []
    if set(init) != set(params):
        failures.append(f"parameter names differ: mpipe-only {sorted(set(init) - set(params))}, "
                        f"torch-only {sorted(set(params) - set(init))}")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(torch.from_numpy(init[key]))

    def batch_of(step):
        g = f[f"batch/{step}"]
        x = torch.from_numpy(g["inputs"][()])
        y = torch.from_numpy(g["targets"][()]).long()
        return (x.long() if args.model == "gpt" else x), y

    # Loss and every gradient at step 0.
    model.zero_grad()
    loss = model(*batch_of(0))
    loss.backward()
    loss0 = float(f["loss0"][0])
    err = abs(loss0 - loss.item()) / abs(loss.item())
    print(f"loss at init: mpipe {loss0:.9g} torch {loss.item():.9g} rel {err:.2e}")
    if err > TOL:
        failures.append(f"initial loss rel error {err:.2e}")
    worst = 0.0
    for key, p in sorted(params.items()):
        e = rel(grads[key], p.grad.numpy())
        worst = max(worst, e)
        if e > TOL:
            failures.append(f"gradient of layer {key[0]} {key[1]}: rel error {e:.2e}")
    print(f"gradients: {len(params)} tensors, worst rel error {worst:.2e}")

    # 10 AdamW steps with mpipe's learning rates; decay on mpipe's decay set.
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(torch.from_numpy(init[key]))
    groups = [{"params": [p for k, p in params.items() if decay[k]], "weight_decay": wd},
              {"params": [p for k, p in params.items() if not decay[k]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(beta1, beta2), eps=eps)
    ours = f["losses"][()]
    for step, lr in enumerate(f["lrs"][()]):
        for g in opt.param_groups:
            g["lr"] = float(lr)
        opt.zero_grad()
        loss = model(*batch_of(step))
        loss.backward()
        opt.step()
        e = abs(ours[step] - loss.item()) / abs(loss.item())
        print(f"step {step}: lr {lr:.3e} loss mpipe {ours[step]:.9g} torch {loss.item():.9g} rel {e:.2e}")
        if e > TOL:
            failures.append(f"loss at step {step}: rel error {e:.2e}")
    worst_key = max(params, key=lambda k: rel(final[k], params[k].detach().numpy()))
    worst_final = rel(final[worst_key], params[worst_key].detach().numpy())
    print(f"parameters after {len(ours)} steps: worst rel error {worst_final:.2e} (layer {worst_key[0]} {worst_key[1]})")
    # Loose on purpose: the key part of c_attn.bias has a true gradient of exactly zero
    # (softmax ignores a shift of all keys), so both sides step it by float noise that
    # Adam normalises to full-size updates of either sign.
    if worst_final > 1e-3:
        failures.append(f"final parameters rel error {worst_final:.2e}")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"reference {args.model}: OK")


if __name__ == "__main__":
    main()
