#!/usr/bin/python3
"""The reference test: the same GPT / Llama / MLP in PyTorch, against mpipe.

Runs mpipe's reference_dump (initial weights, batches, step-0 gradients and logits, 10
AdamW steps), rebuilds the model in PyTorch from those weights, and compares the logits,
the loss and every gradient (relative error below 1e-4, --tol), then the losses of 10
AdamW steps (--steps) with the same learning rates and the parameters after them
(--final-tol). --float64 runs the twin in float64: the comparison is then with the exact
math, mpipe's float32 rounding alone. Exits non-zero on any mismatch.
"""
import argparse
import os
import subprocess
import sys
import tomllib

import h5py
import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
from mpipe_torch import GPT, MLP, Llama, Sequential  # noqa: E402

torch.set_num_threads(2)


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
    ap.add_argument("--model", required=True, help="gpt, llama, mlp or a model file (TOML) of non-sequence layers")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--batchnorm", default="micro", help="micro or deferred (mpipe's --batchnorm)")
    ap.add_argument("--lr", default="1e-2", help="the peak learning rate of the 10 steps")
    ap.add_argument("--final-tol", type=float, default=1e-3,
                    help="relative error allowed in the parameters after the 10 steps (see below)")
    ap.add_argument("--tol", type=float, default=1e-4, help="relative error allowed in the logits, losses and gradients")
    ap.add_argument("--float64", action="store_true", help="the twin in float64 (mpipe's float32 against the exact math)")
    # Passed on to reference_dump: the steps, the vocabulary, the Llama family's options.
    passed = ["--steps", "--vocab", "--seq-len", "--kv-heads", "--ffn", "--tie-embeddings", "--rope-theta", "--norm-eps"]
    for option in passed:
        ap.add_argument(option)
    args = ap.parse_args()
    tol = args.tol
    os.makedirs(args.workdir, exist_ok=True)
    name = os.path.splitext(os.path.basename(args.model))[0]
    path = os.path.join(args.workdir, f"reference-{name}.h5")
    extra = [word for option in passed if getattr(args, option[2:].replace("-", "_")) is not None
             for word in (option, getattr(args, option[2:].replace("-", "_")))]
    subprocess.run([args.dump, "--model", args.model, "--out", path, "--batchnorm", args.batchnorm, "--lr", args.lr, *extra],
                   check=True)

    f = h5py.File(path, "r")
    n_layer, C, H, T, V, hidden, inputs, classes, batch = (int(v) for v in f["config/sizes"][()])
    beta1, beta2, eps, wd = (float(v) for v in f["config/adamw"][()])
    if args.model == "gpt":
        model = GPT(n_layer, C, H, T, V)
    elif args.model == "llama":
        kv_heads, ffn, tie = (int(v) for v in f["config/llama"][()])
        theta, norm_eps = (float(v) for v in f["config/llama_reals"][()])
        model = Llama(n_layer, C, H, T, V, kv_heads=kv_heads, ffn=ffn, rope_theta=theta, eps=norm_eps, tie=bool(tie))
        print(f"llama: {n_layer} blocks, C {C}, {H} heads, {kv_heads} key/value heads, ffn {ffn}, T {T}, V {V}, "
              f"rope-theta {theta:g}, eps {norm_eps:g}, {'tied' if tie else 'untied'} head")
    elif args.model == "mlp":
        model = MLP(n_layer, hidden, inputs, classes)
    else:
        with open(args.model, "rb") as spec:
            model = Sequential(tomllib.load(spec), micro_batches=int(f["config/micro_batches"][0]),
                               batchnorm=args.batchnorm)
    if args.float64:
        model.double()
    if int(f["config/deferred_batchnorm"][0]) != (args.batchnorm == "deferred"):
        sys.exit("reference_dump did not take --batchnorm")
    params = model.named()
    # BatchNorm's running statistics: compared as values, never as gradients or stepped.
    trained = {k: p for k, p in params.items() if isinstance(p, torch.nn.Parameter)}
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
        return (x.long() if args.model in ("gpt", "llama") else x.to(model_dtype)), y

    model_dtype = torch.float64 if args.float64 else torch.float32
    # The logits of step 0's batch (a model of tokens).
    if "logits" in f:
        with torch.no_grad():
            logits = model.logits(batch_of(0)[0])
        e = rel(f["logits"][()], logits.numpy())
        print(f"logits {tuple(logits.shape)}: rel error {e:.2e}")
        if e > tol:
            failures.append(f"logits rel error {e:.2e}")

    # Loss and every gradient at step 0.
    model.zero_grad()
    loss = model(*batch_of(0))
    loss.backward()
    if isinstance(model, Sequential):
        model.apply_deferred(keep=False)  # mpipe applies a step's sums only with its update
    loss0 = float(f["loss0"][0])
    err = abs(loss0 - loss.item()) / abs(loss.item())
    print(f"loss at init: mpipe {loss0:.9g} torch {loss.item():.9g} rel {err:.2e}")
    if err > tol:
        failures.append(f"initial loss rel error {err:.2e}")
    worst, worst_key = 0.0, None
    for key, p in sorted(trained.items()):
        e = rel(grads[key], p.grad.numpy())
        if e >= worst:
            worst, worst_key = e, key
        if e > tol:
            failures.append(f"gradient of layer {key[0]} {key[1]}: rel error {e:.2e}")
    print(f"gradients: {len(trained)} tensors, worst rel error {worst:.2e} (layer {worst_key[0]} {worst_key[1]})")

    # 10 AdamW steps with mpipe's learning rates; decay on mpipe's decay set. The running
    # statistics carry on from the step-0 pass, as mpipe's do.
    with torch.no_grad():
        for key, p in trained.items():
            p.copy_(torch.from_numpy(init[key]))
    groups = [{"params": [p for k, p in trained.items() if decay[k]], "weight_decay": wd},
              {"params": [p for k, p in trained.items() if not decay[k]], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(beta1, beta2), eps=eps)
    ours = f["losses"][()]
    for step, lr in enumerate(f["lrs"][()]):
        for g in opt.param_groups:
            g["lr"] = float(lr)
        opt.zero_grad()
        loss = model(*batch_of(step))
        loss.backward()
        opt.step()
        if isinstance(model, Sequential):
            model.apply_deferred()  # deferred BatchNorm: once per step, as mpipe
        e = abs(ours[step] - loss.item()) / abs(loss.item())
        print(f"step {step}: lr {lr:.3e} loss mpipe {ours[step]:.9g} torch {loss.item():.9g} rel {e:.2e}")
        if e > tol:
            failures.append(f"loss at step {step}: rel error {e:.2e}")
    # The key third of an attention's c_attn.bias has a true gradient of exactly zero
    # (softmax ignores a shift of all keys): both sides step it by float noise that Adam
    # normalises to full-size updates of either sign, so it is no comparison of the two.
    # The final values compare without it (its step-0 gradient is compared above).
    def compared(key, value):
        value = np.asarray(value)
        if key[1].endswith("attn.c_attn.bias"):
            third = value.shape[0] // 3
            return np.concatenate([value[:third], value[2 * third:]])
        return value

    def final_error(key):
        return rel(compared(key, final[key]), compared(key, params[key].detach().numpy()))
    worst_key = max(params, key=final_error)
    worst_final = final_error(worst_key)
    print(f"parameters after {len(ours)} steps: worst rel error {worst_final:.2e} (layer {worst_key[0]} {worst_key[1]})")
    # Looser than the gradients' for the BatchNorm biases inside a residual block whose last
    # BatchNorm starts at scale 0 (the resnet preset): their gradients are that scale times a
    # normal one, float noise weighs in, and Adam's normalisation turns it into steps of
    # either sign (5.4e-4 after 10 steps at --lr 1e-3, while every loss agrees to 1.1e-7):
    # --final-tol.
    if worst_final > args.final_tol:
        failures.append(f"final parameters rel error {worst_final:.2e}")

    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print(f"reference {name}: OK")


if __name__ == "__main__":
    main()
