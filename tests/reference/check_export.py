#!/usr/bin/python3
"""`mpipe export` against PyTorch: a GPT trained a few steps is exported, loaded with
strict=True into a GPT-2 written in Hugging Face's layout (scripts/mpipe_torch.py's
GPT2HF: its names, its Conv1D weights), and its logits equal those of the reference twin
(mpipe_torch.GPT, the one the reference tests hold to mpipe) loaded from the checkpoint
itself, within 1e-5; every exported tensor is the checkpoint's, bit for bit (transposed
where GPT-2 keeps [in, out]). A model file (a ResNet with BatchNorm) exports under the
layer list's own names, which its twin's parameters and running statistics match one
for one. A run directory exports its newest checkpoint. Exits non-zero on any mismatch.
"""
import argparse
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import tomllib

import h5py
import numpy as np
import torch

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "scripts"))
from mpipe_torch import GPT, GPT2HF, Sequential, read_safetensors  # noqa: E402

torch.set_num_threads(1)
failures = []


def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


def keyed(path):
    """A checkpoint's /model as {(layer, name): array}."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                layer, _, pname = name.partition("/")
                out[(int(layer), pname)] = obj[()]
        f["model"].visititems(visit)
    return out


def train(mpipe, work, name, args, steps):
    d = os.path.join(work, name)
    subprocess.run(["mpiexec", "-n", "1", mpipe, "train", *args, "--steps", str(steps), "--threads", "1", "--log-every", "1000",
                    "--checkpoint-dir", d], check=True, stdout=subprocess.DEVNULL)
    return d, os.path.join(d, f"ckpt-{steps:08d}.h5")


def export(mpipe, source, out):
    r = subprocess.run([mpipe, "export", source, out], capture_output=True, text=True)
    check(r.returncode == 0, f"mpipe export {os.path.basename(source)}: exit {r.returncode} {r.stderr.strip()}")
    return read_safetensors(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpipe", required=True)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="mpipe-export-")
    try:
        # ---- GPT: Hugging Face GPT-2's names and layout ----
        L, C, H, T, V = 2, 32, 4, 16, 64
        gpt = ["--model", "gpt", "--layers", str(L), "--d-model", str(C), "--heads", str(H), "--seq-len", str(T),
               "--vocab", str(V), "--batch-size", "4", "--micro-batches", "2", "--dropout", "0.1"]
        run_dir, ckpt = train(a.mpipe, work, "gpt", gpt, 3)
        tensors, meta = export(a.mpipe, run_dir, os.path.join(work, "gpt.safetensors"))  # the directory: its newest
        check(meta.get("mpipe_step") == "3" and meta.get("mpipe_checkpoint", "").endswith("ckpt-00000003.h5"),
              f"metadata names the checkpoint and its step: {meta.get('mpipe_checkpoint')} {meta.get('mpipe_step')}")
        hf = GPT2HF(L, C, H, T, V)
        state = {k: torch.from_numpy(v) for k, v in tensors.items()}
        try:
            hf.load_state_dict(state, strict=True)
            check(True, "GPT-2 layout: load_state_dict(strict=True) takes every exported tensor")
        except RuntimeError as e:
            check(False, f"GPT-2 layout: load_state_dict(strict=True): {e}")
        weights = keyed(ckpt)
        ref = GPT(L, C, H, T, V)
        with torch.no_grad():
            for key, param in ref.named().items():
                param.copy_(torch.from_numpy(weights[key]))
        # Bit for bit: each exported tensor is the checkpoint's dataset (Conv1D's transposed).
        same = True
        for (layer, name), value in weights.items():
            if layer == 0:
                exported = tensors[f"transformer.{name}.weight"]
            elif layer == L + 1:
                exported = tensors[f"transformer.ln_f.{name}"]
            else:
                exported = tensors[f"transformer.h.{layer - 1}.{name}"]
                if name.endswith("weight") and exported.ndim == 2:
                    exported = exported.T
            same = same and exported.shape == value.shape and np.array_equal(np.ascontiguousarray(exported).view(np.uint32), value.view(np.uint32))
        check(same and len(tensors) == len(weights), f"{len(tensors)} tensors, each the checkpoint's bits")
        idx = torch.randint(0, V, (3, T), generator=torch.Generator().manual_seed(7))
        hf.eval()
        with torch.no_grad():
            diff = (hf.logits(idx) - ref.logits(idx)).abs().max().item()
        check(diff <= 1e-5, f"GPT-2 layout's logits against the reference twin's: max |difference| {diff:.2e} <= 1e-5")

        # ---- --init-from: a fresh run on 2 ranks starts from the export ----
        gpt_file = os.path.join(work, "gpt.safetensors")
        r = subprocess.run(["mpiexec", "-n", "2", a.mpipe, "train", *gpt, "--steps", "2", "--threads", "1",
                            "--init-from", gpt_file], capture_output=True, text=True)
        check(r.returncode == 0 and f"initialized from {gpt_file} (--init-from)" in r.stdout,
              f"train --init-from: exit {r.returncode}, {r.stderr.strip()[-200:]}")

        # ---- a model file: the layer list's own names, buffers included ----
        spec_path = os.path.join(here, "resnet-bn.toml")
        with open(spec_path, "rb") as f:
            spec = tomllib.load(f)
        _, ckpt = train(a.mpipe, work, "resnet", ["--model", spec_path, "--batch-size", "8", "--micro-batches", "2"], 2)
        tensors, _ = export(a.mpipe, ckpt, os.path.join(work, "resnet.safetensors"))
        twin = Sequential(spec)
        names = {f"{layer}.{name}": p for (layer, name), p in twin.named().items()}
        check(set(names) == set(tensors), f"model file: the twin's {len(names)} names are the export's {len(tensors)}"
              f" (missing {sorted(set(names) - set(tensors))[:3]}, extra {sorted(set(tensors) - set(names))[:3]})")
        weights = keyed(ckpt)
        check(all(np.array_equal(tensors[f"{k[0]}.{k[1]}"], v) for k, v in weights.items() if f"{k[0]}.{k[1]}" in tensors)
              and len(weights) == len(tensors), "model file: each exported tensor is the checkpoint's")
        check(all(tuple(names[k].shape) == tensors[k].shape for k in names if k in tensors),
              "model file: every shape is the twin's")

        # ---- the resnet preset: torchvision's names; ResNet-18 and -50 load into torchvision ----
        import torchvision
        x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(3))
        for depth, build in [(18, torchvision.models.resnet18), (50, torchvision.models.resnet50)]:
            args = ["--model", "resnet", "--layers", str(depth), "--width", "64", "--image", "128", "--classes", "10",
                    "--batch-size", "2", "--micro-batches", "1"]
            _, ckpt_r = train(a.mpipe, work, f"resnet{depth}", args, 1)
            tensors, _ = export(a.mpipe, ckpt_r, os.path.join(work, f"resnet{depth}.safetensors"))
            tv = build(num_classes=10)
            try:
                tv.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
                check(True, f"ResNet-{depth}: torchvision.models.resnet{depth} takes the export with strict=True")
            except RuntimeError as e:
                check(False, f"ResNet-{depth}: torchvision load_state_dict(strict=True): {str(e)[:300]}")
                continue
            # The reference twin of the checkpoint's own layer list, loaded from the checkpoint.
            text = subprocess.run([a.mpipe, "inspect", ckpt_r, "--model"], capture_output=True, text=True, check=True).stdout
            twin = Sequential(tomllib.loads(text))
            weights = keyed(ckpt_r)
            with torch.no_grad():
                for key, p in twin.named().items():
                    p.copy_(torch.from_numpy(weights[key]))
            tv.eval()
            twin.eval()
            with torch.no_grad():
                y = x
                for kind, part in zip(twin.kinds, twin.parts):
                    if kind != "cross_entropy":
                        y = part(y)
                diff = (tv(x) - y).abs().max().item()
                scale = max(1.0, y.abs().max().item())
            check(diff <= 1e-5 * scale, f"ResNet-{depth}: torchvision's eval logits against the reference twin's: max "
                  f"|difference| {diff:.2e} <= 1e-5 x {scale:.2f}")
            if depth == 18:  # and back: a run on 2 ranks starts from torchvision's names (their batch counts aside)
                r = subprocess.run(["mpiexec", "-n", "2", a.mpipe, "train", *args, "--steps", "1", "--threads", "1",
                                    "--init-from", os.path.join(work, "resnet18.safetensors")], capture_output=True, text=True)
                check(r.returncode == 0 and "(--init-from)" in r.stdout,
                      f"ResNet-18: train --init-from torchvision's names: exit {r.returncode} {r.stderr.strip()[-200:]}")

        # ---- bad input: one line, exit 2, nothing written over an input ----
        damaged = os.path.join(work, "damaged.h5")
        shutil.copy(ckpt, damaged)
        with h5py.File(ckpt, "r") as f:
            offset = f["model/0000/weight"].id.get_offset()
        with open(damaged, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x40]))
        before = open(ckpt, "rb").read()
        taken = os.path.join(work, "taken")  # OUT a directory: OUT/model.safetensors (check_hf.py)
        os.makedirs(os.path.join(taken, "model.safetensors"))
        for what, args, says in [
                ("a damaged checkpoint", [damaged, os.path.join(work, "d.safetensors")], "export an older checkpoint"),
                ("OUT the checkpoint itself", [ckpt, ckpt], "is the checkpoint itself"),
                ("OUT a directory whose model.safetensors is not a file", [ckpt, taken], "is not a file"),
                ("no such checkpoint", [os.path.join(work, "none.h5"), os.path.join(work, "n.safetensors")], "no file"),
                ("not a checkpoint", [spec_path, os.path.join(work, "s.safetensors")], "not an HDF5 file"),
                ("no OUT", [ckpt], "out is required")]:
            r = subprocess.run([a.mpipe, "export", *args], capture_output=True, text=True)
            lines = [line for line in r.stderr.splitlines() if line.strip()]
            check(r.returncode == 2 and len(lines) == 1 and says in lines[0] and "mpipe: error" in lines[0],
                  f"{what}: exit {r.returncode}, {lines}")
        check(open(ckpt, "rb").read() == before, "the checkpoint is untouched")
        # --init-from with a bad file: one line naming the problem, exit 2, on every rank.
        raw = open(gpt_file, "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        bad = {"another model's": os.path.join(work, "resnet.safetensors")}
        for name, data in [("truncated", raw[:-100]), ("lying about its length", struct.pack("<Q", n + 10**9) + raw[8:]),
                           ("with a shape changed", raw.replace(b'"shape":[16,32]', b'"shape":[32,16]', 1))]:
            bad[name] = os.path.join(work, name.replace(" ", "_") + ".safetensors")
            with open(bad[name], "wb") as f:
                f.write(data)
        for name, path, says in [("another model's", bad["another model's"], "has no tensor 'transformer."),
                                 ("truncated", bad["truncated"], "truncated"),
                                 ("lying about its length", bad["lying about its length"], "its header says"),
                                 ("with a shape changed", bad["with a shape changed"], "is (32, 16), this model's is (16, 32)")]:
            r = subprocess.run(["mpiexec", "-n", "2", a.mpipe, "train", *gpt, "--steps", "2", "--threads", "1",
                                "--init-from", path], capture_output=True, text=True)
            lines = [line for line in r.stderr.splitlines() if "mpipe: error" in line]
            check(r.returncode == 2 and len(lines) == 1 and says in lines[0],
                  f"--init-from a file {name}: exit {r.returncode}, {lines or r.stderr.strip()[-300:]}")
        check(not os.path.exists(os.path.join(work, "d.safetensors")), "nothing written for a damaged checkpoint")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("every check passed")


if __name__ == "__main__":
    main()
