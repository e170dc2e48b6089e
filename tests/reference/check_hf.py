#!/usr/bin/python3
"""Hugging Face interop for the Llama family, and export directories for GPT-2.

A tiny llama (grouped-query attention, untied head) is trained two steps and exported
to a directory: model.safetensors holds LlamaForCausalLM's names and shapes, each tensor
the checkpoint's rows bit for bit (q, k, v split from c_attn; gate, up from c_fc), and
loads with strict=True into a LlamaForCausalLM written here in PyTorch (Hugging Face's
layout and math: RMSNorm, rotate-half RoPE, repeat_kv, SwiGLU); config.json has
LlamaConfig's fields. Python then writes a copy in bfloat16 and float16, sharded over two
files with an index (half the names without "model.", a rotary inv_freq buffer beside
them), and `train --init-from` reads it on 2 ranks (the head in vocabulary chunks): the
run's weights, exported again, are those values. A config.json that disagrees, a shard
missing, a tied model from untied weights: one line, exit 2. A tied llama exports no
lm_head.weight. A GPT exported to a directory has GPT2LMHeadModel's config.json and
loads back. Where `mpipe generate` runs a llama, its greedy tokens are the PyTorch
model's argmax at each step. Exits 77 (skipped) where this build has no llama preset.
"""
import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "..", "scripts"))
from check_export import check, failures, keyed  # noqa: E402
from mpipe_torch import GPT2HF, read_safetensors  # noqa: E402

torch.set_num_threads(1)


# ---- safetensors, read and written here (no safetensors package) ----

def read_tensors(path):
    """{name: float32 torch tensor} of a safetensors file (F32, BF16, F16), its metadata and dtypes."""
    dtypes = {}
    arrays, meta = read_safetensors(path, dtypes)
    return {name: torch.from_numpy(a) for name, a in arrays.items()}, meta, dtypes


def write_tensors(path, tensors):
    """tensors: {name: (dtype, float32 tensor)}; written as that dtype."""
    header, blobs, at = {}, [], 0
    for name, (dtype, value) in tensors.items():
        if dtype == "BF16":
            raw = value.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        else:
            raw = value.to({"F32": torch.float32, "F16": torch.float16}[dtype]).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(value.shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def rounded(dtype, value):
    return value.to({"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[dtype]).float()


# ---- Hugging Face's LlamaForCausalLM, its layout and math ----

class RMSNorm(torch.nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaHF(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        C, H, KV = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hs, Fw, V, eps = cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"], cfg["rms_norm_eps"]
        self.H, self.KV, self.hs, self.theta = H, KV, hs, cfg["rope_theta"]
        m = self.model = torch.nn.Module()
        m.embed_tokens = torch.nn.Embedding(V, C)
        m.layers = torch.nn.ModuleList()
        for _ in range(cfg["num_hidden_layers"]):
            b = torch.nn.Module()
            b.input_layernorm, b.post_attention_layernorm = RMSNorm(C, eps), RMSNorm(C, eps)
            a = b.self_attn = torch.nn.Module()
            a.q_proj, a.k_proj = torch.nn.Linear(C, H * hs, bias=False), torch.nn.Linear(C, KV * hs, bias=False)
            a.v_proj, a.o_proj = torch.nn.Linear(C, KV * hs, bias=False), torch.nn.Linear(H * hs, C, bias=False)
            p = b.mlp = torch.nn.Module()
            p.gate_proj, p.up_proj = torch.nn.Linear(C, Fw, bias=False), torch.nn.Linear(C, Fw, bias=False)
            p.down_proj = torch.nn.Linear(Fw, C, bias=False)
            m.layers.append(b)
        m.norm = RMSNorm(C, eps)
        self.tied = cfg["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = torch.nn.Linear(C, V, bias=False)

    def logits(self, idx):
        B, T = idx.shape
        x = self.model.embed_tokens(idx)
        inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.hs, 2, dtype=torch.float32) / self.hs))
        angles = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rope(u):  # rotate_half: dimension i pairs with i + hs/2
            u1, u2 = u[..., : self.hs // 2], u[..., self.hs // 2:]
            return u * cos + torch.cat([-u2, u1], -1) * sin

        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        for b in self.model.layers:
            h = b.input_layernorm(x)
            a = b.self_attn
            q = rope(a.q_proj(h).view(B, T, self.H, self.hs).transpose(1, 2))
            k = rope(a.k_proj(h).view(B, T, self.KV, self.hs).transpose(1, 2))
            v = a.v_proj(h).view(B, T, self.KV, self.hs).transpose(1, 2)
            k, v = (u.repeat_interleave(self.H // self.KV, dim=1) for u in (k, v))  # repeat_kv
            att = ((q @ k.transpose(-2, -1)) / self.hs ** 0.5).masked_fill(mask, float("-inf")).softmax(-1)
            x = x + a.o_proj((att @ v).transpose(1, 2).reshape(B, T, -1))
            h = b.post_attention_layernorm(x)
            x = x + b.mlp.down_proj(F.silu(b.mlp.gate_proj(h)) * b.mlp.up_proj(h))
        x = self.model.norm(x)
        return x @ (self.model.embed_tokens.weight if self.tied else self.lm_head.weight).t()


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def error_lines(r):
    return [line for line in r.stderr.splitlines() if "mpipe: error" in line]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mpipe", required=True)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="mpipe-hf-")
    try:
        L, C, H, KV, FW, T, V = 2, 32, 4, 2, 48, 16, 64
        hs = C // H
        llama = ["--model", "llama", "--layers", str(L), "--d-model", str(C), "--heads", str(H), "--kv-heads", str(KV),
                 "--ffn", str(FW), "--seq-len", str(T), "--vocab", str(V), "--batch-size", "8", "--micro-batches", "2",
                 "--lr", "0.01", "--threads", "1", "--log-every", "1000"]

        def train(name, args, steps, ranks=1, extra=()):
            d = os.path.join(work, name)
            r = run(["mpiexec", "-n", str(ranks), "--oversubscribe", a.mpipe, "train", *args, "--steps", str(steps),
                     "--checkpoint-dir", d, *extra])
            return r, d, os.path.join(d, f"ckpt-{steps:08d}.h5")

        r, run_dir, ckpt = train("llama", [*llama, "--tie-embeddings", "off"], 2)
        if r.returncode != 0 and ("llama" in r.stderr and ("unknown" in r.stderr or "is not" in r.stderr)):
            print(f"not run: this build has no llama preset ({r.stderr.strip()[-200:]})")
            sys.exit(77)
        check(r.returncode == 0, f"train --model llama: exit {r.returncode} {r.stderr.strip()[-300:]}")
        if r.returncode != 0:
            raise SystemExit(1)

        # ---- export to a directory: LlamaForCausalLM's names, the checkpoint's rows ----
        out = os.path.join(work, "llama-hf") + "/"
        r = run([a.mpipe, "export", run_dir, out])
        check(r.returncode == 0 and "Hugging Face Llama" in r.stdout, f"mpipe export DIR/: exit {r.returncode} {r.stdout.strip()} {r.stderr.strip()}")
        tensors, meta, dtypes = read_tensors(os.path.join(out, "model.safetensors"))
        want = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,), "lm_head.weight": (V, C)}
        for i in range(L):
            b = f"model.layers.{i}."
            want.update({b + "input_layernorm.weight": (C,), b + "post_attention_layernorm.weight": (C,),
                         b + "self_attn.q_proj.weight": (H * hs, C), b + "self_attn.k_proj.weight": (KV * hs, C),
                         b + "self_attn.v_proj.weight": (KV * hs, C), b + "self_attn.o_proj.weight": (C, H * hs),
                         b + "mlp.gate_proj.weight": (FW, C), b + "mlp.up_proj.weight": (FW, C),
                         b + "mlp.down_proj.weight": (C, FW)})
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        check(shapes == want, f"the export's {len(shapes)} names and shapes are LlamaForCausalLM's {len(want)}"
              f" (missing {sorted(set(want) - set(shapes))[:3]}, extra {sorted(set(shapes) - set(want))[:3]},"
              f" shapes {[(k, shapes[k], want[k]) for k in want if k in shapes and shapes[k] != want[k]][:3]})")
        check(set(dtypes.values()) == {"F32"} and meta.get("mpipe_step") == "2", f"F32, step 2: {set(dtypes.values())} {meta.get('mpipe_step')}")
        weights = {k: torch.from_numpy(v) for k, v in keyed(ckpt).items()}
        rows = {"model.embed_tokens.weight": weights[(0, "wte")], "model.norm.weight": weights[(L + 1, "weight")],
                "lm_head.weight": weights[(L + 2, "weight")]}
        for i in range(L):
            b, w = f"model.layers.{i}.", lambda name, i=i: weights[(i + 1, name)]
            qkv, fc = w("attn.c_attn.weight"), w("mlp.c_fc.weight")
            rows.update({b + "input_layernorm.weight": w("ln_1.weight"), b + "post_attention_layernorm.weight": w("ln_2.weight"),
                         b + "self_attn.q_proj.weight": qkv[:H * hs], b + "self_attn.k_proj.weight": qkv[H * hs:(H + KV) * hs],
                         b + "self_attn.v_proj.weight": qkv[(H + KV) * hs:], b + "self_attn.o_proj.weight": w("attn.c_proj.weight"),
                         b + "mlp.gate_proj.weight": fc[:FW], b + "mlp.up_proj.weight": fc[FW:],
                         b + "mlp.down_proj.weight": w("mlp.c_proj.weight")})
        same = [k for k in want if k in tensors and torch.equal(tensors[k].view(torch.int32), rows[k].contiguous().view(torch.int32))]
        check(len(same) == len(want) == len(weights) + 3 * L,
              f"each tensor is the checkpoint's rows, bit for bit ({len(same)} of {len(want)}; {len(weights)} parameters)")
        with open(os.path.join(out, "config.json")) as f:
            config = json.load(f)
        expect = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": C, "intermediate_size": FW,
                  "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV, "head_dim": hs,
                  "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
                  "max_position_embeddings": T, "vocab_size": V, "torch_dtype": "float32", "hidden_act": "silu",
                  "attention_bias": False, "mlp_bias": False}
        wrong = {k: (config.get(k), v) for k, v in expect.items() if config.get(k) != v}
        check(not wrong, f"config.json has LlamaConfig's fields: {wrong or 'all as expected'}")
        hf = LlamaHF(config)
        try:
            hf.load_state_dict(tensors, strict=True)
            check(True, "LlamaForCausalLM's layout: load_state_dict(strict=True) takes every exported tensor")
        except RuntimeError as e:
            check(False, f"LlamaForCausalLM's layout: load_state_dict(strict=True): {str(e)[:300]}")
        hf.eval()
        # An existing directory, named without '/': the same files.
        existing = os.path.join(work, "existing")
        os.mkdir(existing)
        r = run([a.mpipe, "export", ckpt, existing])
        again, _, _ = read_tensors(os.path.join(existing, "model.safetensors"))
        check(r.returncode == 0 and os.path.exists(os.path.join(existing, "config.json")) and
              all(torch.equal(again[k], tensors[k]) for k in tensors) and len(again) == len(tensors),
              f"an existing directory: model.safetensors and config.json (exit {r.returncode} {r.stderr.strip()})")

        # ---- a bf16/f16 copy sharded over two files, read by --init-from on 2 ranks ----
        shards = os.path.join(work, "sharded")
        os.mkdir(shards)
        names = sorted(tensors)
        plan = {}  # name -> (name in the file, dtype, shard)
        for i, name in enumerate(names):
            stored = name[len("model."):] if i % 2 and name.startswith("model.") else name  # LlamaModel's own names too
            plan[name] = (stored, "F16" if i % 3 == 0 else "BF16", 1 if i < len(names) // 2 else 2)
        weight_map, files = {}, {1: {}, 2: {}}
        for name, (stored, dtype, shard) in plan.items():
            files[shard][stored] = (dtype, tensors[name])
        files[2]["model.rotary_emb.inv_freq"] = ("F32", 1.0 / (10000.0 ** (torch.arange(0, hs, 2).float() / hs)))
        for shard, content in files.items():
            file = f"model-0000{shard}-of-00002.safetensors"
            write_tensors(os.path.join(shards, file), content)
            weight_map.update({k: file for k in content})
        with open(os.path.join(shards, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
        shutil.copy(os.path.join(out, "config.json"), shards)
        # --lr 1e-30: one step that moves no weight (an update far below each value's last bit).
        args = [*llama, "--tie-embeddings", "off", "--lr", "1e-30", "--weight-decay", "0", "--head-chunks", "2"]
        r, loaded_dir, _ = train("loaded", args, 1, ranks=2, extra=["--init-from", shards])
        check(r.returncode == 0 and f"initialized from {shards} (--init-from)" in r.stdout,
              f"train --init-from a sharded bf16/f16 directory on 2 ranks, head in 2 chunks: exit {r.returncode} {r.stderr.strip()[-300:]}")
        r = run([a.mpipe, "export", loaded_dir, os.path.join(work, "loaded.safetensors")])
        back, _, _ = read_tensors(os.path.join(work, "loaded.safetensors"))
        expected = {name: rounded(dtype, tensors[name]) for name, (_, dtype, _) in plan.items()}
        exact = [k for k in expected if k in back and torch.equal(back[k], expected[k])]
        diff = max(((back[k] - expected[k]).abs().max().item() for k in expected if k in back and back[k].shape == expected[k].shape), default=-1)
        check(r.returncode == 0 and set(back) == set(expected) and diff <= 1e-28,
              f"the loaded weights are the files' bf16/f16 values: {len(exact)} of {len(expected)} tensors bit for bit,"
              f" max |difference| {diff:.1e} (a step of lr 1e-30)")

        # A run that resumes needs its --init-from no more: the files may be gone.
        r, _, _ = train("loaded", args, 2, ranks=2, extra=["--init-from", os.path.join(work, "gone") + "/"])
        check(r.returncode == 0 and "not applied" in r.stdout, f"a resumed run with --init-from gone: exit {r.returncode} {r.stderr.strip()[-200:]}")

        # ---- bad input: one line naming the file and the field or tensor, exit 2 ----
        def refused(what, path, says, model_args=None):
            r = run(["mpiexec", "-n", "2", "--oversubscribe", a.mpipe, "train", *(model_args or args), "--steps", "1",
                     "--init-from", path])
            lines = error_lines(r)
            check(r.returncode == 2 and len(lines) == 1 and all(s in lines[0] for s in says),
                  f"{what}: exit {r.returncode}, {lines or r.stderr.strip()[-300:]}")

        bad = os.path.join(work, "bad-config")
        shutil.copytree(shards, bad)
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump({**config, "num_key_value_heads": 4}, f)
        refused("config.json with other kv heads", bad,
                [f"'{bad}/config.json' disagrees with this model: num_key_value_heads is 4, this model's is 2"])
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump({**config, "rope_theta": 500000.0}, f)
        refused("config.json with another rope_theta", bad, ["config.json", "rope_theta is 500000.0, this model's is 10000.0"])
        shutil.copy(os.path.join(shards, "config.json"), bad)
        os.remove(os.path.join(bad, "model-00002-of-00002.safetensors"))
        refused("a shard missing", bad, [f"'{bad}/model.safetensors.index.json' names shard 'model-00002-of-00002.safetensors', which is not there"])
        refused("no such path", os.path.join(work, "gone") + "/", ["no file or directory"])
        fifo = os.path.join(work, "fifo.safetensors")
        os.mkfifo(fifo)
        refused("a FIFO (never opened: it would block)", fifo, [f"'{fifo}' is a FIFO"])
        # A NaN among the weights (a run that diverged): refused by tensor and element, not
        # loaded to skip every step.
        nan_dir = os.path.join(work, "nan-weights")
        shutil.copytree(shards, nan_dir)
        with open(os.path.join(nan_dir, "model-00001-of-00002.safetensors"), "r+b") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
            name = sorted(k for k in header if k != "__metadata__")[0]
            nan = {"F32": struct.pack("<I", 0x7FC00000), "BF16": struct.pack("<H", 0x7FC0), "F16": struct.pack("<H", 0x7E00)}
            dtype = header[name]["dtype"]
            f.seek(8 + n + header[name]["data_offsets"][0] + 3 * len(nan[dtype]))
            f.write(nan[dtype])
        refused("a NaN weight", nan_dir, [f"tensor '{name}' holds NaN at element 3"])
        refused("a model of 3 layers", shards, ["config.json", "num_hidden_layers is 2, this model's is 3"],
                [*args[:args.index("--layers") + 1], "3", *args[args.index("--layers") + 2:]])

        # ---- tied: no lm_head.weight; untied weights into a tied model refused ----
        r, tied_dir, _ = train("tied", [*llama, "--tie-embeddings", "on"], 1)
        tied_out = os.path.join(work, "tied-hf") + "/"
        r = run([a.mpipe, "export", tied_dir, tied_out])
        t_tensors, _, _ = read_tensors(os.path.join(tied_out, "model.safetensors"))
        with open(os.path.join(tied_out, "config.json")) as f:
            t_config = json.load(f)
        check(r.returncode == 0 and "lm_head.weight" not in t_tensors and len(t_tensors) == len(want) - 1 and
              t_config.get("tie_word_embeddings") is True,
              f"a tied llama: no lm_head.weight, tie_word_embeddings true (exit {r.returncode})")
        tied_hf = LlamaHF(t_config)
        try:
            tied_hf.load_state_dict(t_tensors, strict=True)
            check(True, "a tied llama: load_state_dict(strict=True)")
        except RuntimeError as e:
            check(False, f"a tied llama: load_state_dict(strict=True): {str(e)[:300]}")
        tied_args = [*llama, "--tie-embeddings", "on"]
        refused("untied weights into a tied model", out, ["config.json", "tie_word_embeddings is false, this model's is true"], tied_args)
        lonely = os.path.join(work, "lonely.safetensors")
        shutil.copy(os.path.join(out, "model.safetensors"), lonely)
        refused("untied weights without config.json into a tied model", lonely,
                [lonely, "'lm_head.weight' differs from 'model.embed_tokens.weight'"], tied_args)
        lonely_tied = os.path.join(work, "lonely-tied.safetensors")
        shutil.copy(os.path.join(tied_out, "model.safetensors"), lonely_tied)
        refused("tied weights into an untied model", lonely_tied, ["has no tensor 'lm_head.weight'", "--tie-embeddings on"],
                [*llama, "--tie-embeddings", "off"])

        # ---- greedy generation against the PyTorch model, where mpipe generates a llama ----
        prompt = [5, 17, 3, 60, 2]
        prompt_file = os.path.join(work, "prompt.bin")
        np.array(prompt, dtype="<u2").tofile(prompt_file)
        r = subprocess.run([a.mpipe, "generate", "--threads", "1", "--checkpoint", ckpt, "--prompt-tokens", prompt_file,
                            "--tokens", str(T - len(prompt)), "--temperature", "0"], capture_output=True, timeout=120)
        if r.returncode != 0:
            print(f"not run: greedy generation (mpipe generate: exit {r.returncode} {r.stderr.decode(errors='replace').strip()[-200:]})")
        else:
            got = [int(t) for t in r.stdout.split()]
            with torch.no_grad():
                logits = hf.logits(torch.tensor([got[:-1]]))[0]
            # Each new token is the PyTorch model's argmax there (within 1e-5 of its largest logit).
            gaps = [(logits[i].max() - logits[i][got[i + 1]]).item() for i in range(len(prompt) - 1, len(got) - 1)]
            check(got[:len(prompt)] == prompt and len(gaps) == T - len(prompt) and max(gaps) <= 1e-5,
                  f"greedy: each of mpipe generate's {len(gaps)} tokens is the exported model's argmax in PyTorch"
                  f" (largest gap {max(gaps, default=-1):.1e})")

        # ---- GPT-2 to a directory: GPT2LMHeadModel's config.json, and back ----
        G, GC, GH = 2, 32, 4
        gpt = ["--model", "gpt", "--layers", str(G), "--d-model", str(GC), "--heads", str(GH), "--seq-len", str(T),
               "--vocab", str(V), "--batch-size", "4", "--micro-batches", "2", "--threads", "1", "--log-every", "1000"]
        r, gpt_dir, _ = train("gpt", gpt, 1)
        gpt_out = os.path.join(work, "gpt-hf") + "/"
        r = run([a.mpipe, "export", gpt_dir, gpt_out])
        with open(os.path.join(gpt_out, "config.json")) as f:
            g_config = json.load(f)
        g_expect = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": GC, "n_layer": G, "n_head": GH,
                    "n_positions": T, "n_ctx": T, "vocab_size": V, "layer_norm_epsilon": 1e-5,
                    "activation_function": "gelu_new", "tie_word_embeddings": True}
        g_wrong = {k: (g_config.get(k), v) for k, v in g_expect.items() if g_config.get(k) != v}
        check(r.returncode == 0 and not g_wrong, f"GPT to a directory: config.json has GPT2Config's fields: {g_wrong or 'all'}")
        g_tensors, _, _ = read_tensors(os.path.join(gpt_out, "model.safetensors"))
        try:
            GPT2HF(G, GC, GH, T, V).load_state_dict(g_tensors, strict=True)
            check(True, "GPT to a directory: GPT2LMHeadModel's layout, strict=True")
        except RuntimeError as e:
            check(False, f"GPT to a directory: load_state_dict(strict=True): {str(e)[:300]}")
        r = run(["mpiexec", "-n", "2", "--oversubscribe", a.mpipe, "train", *gpt, "--steps", "1", "--init-from", gpt_out])
        check(r.returncode == 0 and "(--init-from)" in r.stdout, f"GPT: train --init-from DIR/: exit {r.returncode} {r.stderr.strip()[-200:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} check(s) failed")
        sys.exit(1)
    print("every check passed")


if __name__ == "__main__":
    main()
