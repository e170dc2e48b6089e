#!/usr/bin/env python3
"""PyTorch side of scripts/gpu_check.sh: training-step throughput and peak memory of the
models mpipe trains on a GPU, in PyTorch, for a side-by-side report.

  torch_gpu_bench.py gpt    [--mode eager|compile] [--layers 24 --d-model 1024 --heads 16
                             --seq-len 1024 --vocab 50257 --batch-size 8]
  torch_gpu_bench.py resnet [--mode eager|compile] [--layers 50 --image 224 --width 64
                             --classes 1000 --batch-size 64]
  torch_gpu_bench.py llama  [--mode eager|compile] [--layers 16 --d-model 2048 --heads 32
                             --kv-heads 8 --ffn 8192 --seq-len 1024 --vocab 32000 --batch-size 8
                             --rope-theta 500000 --norm-eps 1e-5 --tie-embeddings on|off]
  either with --micro-batches M: the batch as M equal pieces, forward and backward of each
  with its loss / M, gradients accumulated, one clip and one AdamW step (PyTorch's way of
  running what a pipeline stage runs: mpipe's --micro-batches M on one rank).

GPT: GPT-2 as mpipe's preset builds it (token and position embeddings, pre-LN blocks
with biases, tanh GELU, final LayerNorm, the head tied to the token table), attention
through F.scaled_dot_product_attention (causal; flash attention where PyTorch has it).
Llama: as Hugging Face's LlamaForCausalLM (token embedding, no position table, pre-norm
blocks with RMSNorm (torch.nn.RMSNorm where PyTorch has it, else LlamaRMSNorm's
arithmetic: statistics in fp32, the normalised row cast back before the weight), RoPE by
rotate-half on q and k, grouped-query attention (--kv-heads key/value heads: SDPA's
enable_gqa where PyTorch has it, else repeat_kv), SwiGLU MLP, no biases, final RMSNorm,
the head tied to the token table or not), q, k and v from one projection and gate and up
from one (as mpipe lays them out).
ResNet: torchvision's v1.5 (the stride on the 3x3 convolution) written out here, so
torchvision is not needed, with mpipe's stems (ImageNet's 7x7/2 and max pool from 128
pixels on, CIFAR's 3x3/1 below) and the same parameter count (25,557,032 for ResNet-50 at
1000 classes); channels_last unless --no-channels-last.

Both: bf16 autocast, fp32 weights, AdamW (fused where PyTorch has it; lr 1e-4, no weight
decay), gradient norm clipped to 1 (mpipe's defaults), synthetic data made once on the
device. The warm-up steps (compilation included) are not timed; each timed step is
bracketed by torch.cuda.synchronize(). Prints one JSON object as its last line:
median and mean step time, tokens/s (GPT) and samples/s, peak memory
(torch.cuda.max_memory_allocated / max_memory_reserved over the whole process: weights,
gradients, optimizer state and activations), parameters, warm-up seconds.
Exit 0; 3 when the mode is not available (torch.compile on an old PyTorch); 1 on error.
--device cpu runs the same code on the CPU (for checking the script without a GPU).
"""
import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F


# ---- GPT-2 -------------------------------------------------------------------------------
class Block(torch.nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.H = H
        self.ln_1 = torch.nn.LayerNorm(C)
        self.c_attn = torch.nn.Linear(C, 3 * C)
        self.c_proj = torch.nn.Linear(C, C)
        self.ln_2 = torch.nn.LayerNorm(C)
        self.c_fc = torch.nn.Linear(C, 4 * C)
        self.mlp_proj = torch.nn.Linear(4 * C, C)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # PyTorch < 2.0
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
            mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
            y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, layers, C, H, T, V):
        super().__init__()
        self.wte = torch.nn.Embedding(V, C)
        self.wpe = torch.nn.Embedding(T, C)
        self.blocks = torch.nn.ModuleList(Block(C, H) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(C)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # the tied head
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---- Llama ---------------------------------------------------------------------------------
def torch_version():
    return tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2] if v.isdigit())


class RMSNorm(torch.nn.Module):
    """Hugging Face's LlamaRMSNorm: fp32 statistics, the normalised row in the input's type
    times the weight (torch.nn.RMSNorm's fused kernel where PyTorch has one)."""

    def __init__(self, C, eps):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(C))

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(T, hs, theta, device):
    """cos and sin (T, hs) of rotate-half RoPE: angle t theta^(-2i/hs), in double, as fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


SDPA_GQA = hasattr(F, "scaled_dot_product_attention") and torch_version() >= (2, 5)  # enable_gqa from 2.5


class LlamaBlock(torch.nn.Module):
    def __init__(self, C, H, KVH, ffn, eps):
        super().__init__()
        self.H, self.KVH, self.hs, self.ffn = H, KVH, C // H, ffn
        self.input_norm = RMSNorm(C, eps)
        self.qkv = torch.nn.Linear(C, C + 2 * KVH * (C // H), bias=False)
        self.o_proj = torch.nn.Linear(C, C, bias=False)
        self.post_norm = RMSNorm(C, eps)
        self.gate_up = torch.nn.Linear(C, 2 * ffn, bias=False)
        self.down_proj = torch.nn.Linear(ffn, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        KV = self.KVH * self.hs
        q, k, v = self.qkv(self.input_norm(x)).split([C, KV, KV], dim=2)
        q = q.view(B, T, self.H, self.hs).transpose(1, 2)
        k = k.view(B, T, self.KVH, self.hs).transpose(1, 2)
        v = v.view(B, T, self.KVH, self.hs).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # bf16 under autocast: q and k stay bf16 for SDPA
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if SDPA_GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.KVH != self.H)
        else:  # repeat_kv: each key/value head once per query head of its group
            k = k.repeat_interleave(self.H // self.KVH, dim=1)
            v = v.repeat_interleave(self.H // self.KVH, dim=1)
            if hasattr(F, "scaled_dot_product_attention"):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # PyTorch < 2.0
                att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hs)
                mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
                y = att.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        x = x + self.o_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Llama(torch.nn.Module):
    def __init__(self, layers, C, H, KVH, ffn, T, V, theta, eps, tie):
        super().__init__()
        self.embed = torch.nn.Embedding(V, C)
        self.blocks = torch.nn.ModuleList(LlamaBlock(C, H, KVH, ffn, eps) for _ in range(layers))
        self.norm = RMSNorm(C, eps)
        self.lm_head = None if tie else torch.nn.Linear(C, V, bias=False)
        cos, sin = rope_tables(T, C // H, theta, "cpu")
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for p in self.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.embed(idx)
        cos, sin = self.cos[:T], self.sin[:T]
        for b in self.blocks:
            x = b(x, cos, sin)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.norm(x), head)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---- ResNet (torchvision's v1.5, written out) ---------------------------------------------
def conv_bn(cin, cout, kernel, stride):
    return [torch.nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), torch.nn.BatchNorm2d(cout)]


class Residual(torch.nn.Module):
    def __init__(self, cin, width, stride, bottleneck):
        super().__init__()
        out = 4 * width if bottleneck else width
        if bottleneck:
            layers = (conv_bn(cin, width, 1, 1) + [torch.nn.ReLU(inplace=True)] + conv_bn(width, width, 3, stride)
                      + [torch.nn.ReLU(inplace=True)] + conv_bn(width, out, 1, 1))
        else:
            layers = conv_bn(cin, width, 3, stride) + [torch.nn.ReLU(inplace=True)] + conv_bn(width, width, 3, 1)
        torch.nn.init.zeros_(layers[-1].weight)  # the block's last BatchNorm starts at scale 0, as mpipe's
        self.body = torch.nn.Sequential(*layers)
        self.skip = torch.nn.Sequential(*conv_bn(cin, out, 1, stride)) if stride != 1 or cin != out else None
        self.out = out

    def forward(self, x):
        return F.relu(self.body(x) + (x if self.skip is None else self.skip(x)), inplace=True)


RESNET_BLOCKS = {18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3], 101: [3, 4, 23, 3], 152: [3, 8, 36, 3]}


class ResNet(torch.nn.Module):
    def __init__(self, depth, image, width, classes, channels=3):
        super().__init__()
        bottleneck = depth >= 50
        if image >= 128:
            stem = [torch.nn.Conv2d(channels, width, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(width),
                    torch.nn.ReLU(inplace=True), torch.nn.MaxPool2d(3, 2, 1)]
        else:
            stem = conv_bn(channels, width, 3, 1) + [torch.nn.ReLU(inplace=True)]
        layers, cin = stem, width
        for stage, n in enumerate(RESNET_BLOCKS[depth]):
            for b in range(n):
                block = Residual(cin, width << stage, 2 if stage > 0 and b == 0 else 1, bottleneck)
                layers.append(block)
                cin = block.out
        self.features = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, torch.nn.Conv2d):
                torch.nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x, targets):
        x = self.features(x).mean(dim=(2, 3))
        return F.cross_entropy(self.fc(x).float(), targets)


# ---- the timed loop ---------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=["gpt", "resnet", "llama"])
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--d-model", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int, help="llama: key/value heads (default 8)")
    ap.add_argument("--ffn", type=int, default=8192, help="llama: the MLP's hidden width")
    ap.add_argument("--rope-theta", type=float, default=500000.0, help="llama: RoPE's base")
    ap.add_argument("--norm-eps", type=float, default=1e-5, help="llama: RMSNorm's epsilon")
    ap.add_argument("--tie-embeddings", choices=["on", "off"], default="on", help="llama: the head is the token table")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--image", type=int, default=224)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--batch-size", type=int)
    ap.add_argument("--micro-batches", type=int, default=1, help="gradient accumulation over this many equal pieces")
    ap.add_argument("--no-channels-last", action="store_true")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens in the first)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()
    gpt, llama = a.model == "gpt", a.model == "llama"
    lm = gpt or llama  # a language model: tokens in, tokens/s out
    a.layers = a.layers or (24 if gpt else 16 if llama else 50)
    a.batch_size = a.batch_size or (8 if lm else 64)
    a.d_model = a.d_model or (2048 if llama else 1024)
    a.heads = a.heads or (32 if llama else 16)
    a.kv_heads = a.kv_heads or (8 if llama else a.heads)
    a.vocab = a.vocab or (32000 if llama else 50257)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    result = {"model": a.model, "mode": a.mode, "torch": torch.__version__, "batch_size": a.batch_size,
              "micro_batches": a.micro_batches, "layers": a.layers, "warmup_steps": a.warmup, "timed_steps": a.steps}

    def finish(code):
        line = json.dumps(result)
        print(line, flush=True)
        if a.json:
            with open(a.json, "w") as f:
                f.write(line + "\n")
        sys.exit(code)

    if a.micro_batches < 1 or a.batch_size % a.micro_batches:
        result["error"] = f"--micro-batches {a.micro_batches} does not divide the batch of {a.batch_size}"
        finish(2)
    if cuda and not torch.cuda.is_available():
        result["error"] = "torch.cuda.is_available() is False"
        finish(3)
    if a.mode == "compile" and not hasattr(torch, "compile"):
        result["error"] = f"torch.compile is not in PyTorch {torch.__version__}"
        finish(3)
    torch.manual_seed(0)
    if cuda:
        result["device"] = torch.cuda.get_device_name(dev)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    if llama and (a.d_model % a.heads or a.heads % a.kv_heads or (a.d_model // a.heads) % 2):
        result["error"] = (f"--d-model {a.d_model}, --heads {a.heads}, --kv-heads {a.kv_heads}: heads must split the"
                           " model into even head sizes and key/value heads must divide them")
        finish(2)
    if lm:
        if gpt:
            model = GPT(a.layers, a.d_model, a.heads, a.seq_len, a.vocab).to(dev)
        else:
            model = Llama(a.layers, a.d_model, a.heads, a.kv_heads, a.ffn, a.seq_len, a.vocab, a.rope_theta,
                          a.norm_eps, a.tie_embeddings == "on").to(dev)
            result.update(kv_heads=a.kv_heads, ffn=a.ffn, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
                          tie_embeddings=a.tie_embeddings, sdpa_gqa=SDPA_GQA)
        x = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), device=dev)
        y = torch.randint(0, a.vocab, (a.batch_size, a.seq_len), device=dev)
        result.update(d_model=a.d_model, heads=a.heads, seq_len=a.seq_len, vocab=a.vocab,
                      sdpa=hasattr(F, "scaled_dot_product_attention"))
    else:
        model = ResNet(a.layers, a.image, a.width, a.classes).to(dev)
        x = torch.randn(a.batch_size, 3, a.image, a.image, device=dev)
        y = torch.randint(0, a.classes, (a.batch_size,), device=dev)
        channels_last = not a.no_channels_last
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        result.update(image=a.image, width=a.width, classes=a.classes, channels_last=channels_last)
    result["params"] = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=cuda)
        result["adamw"] = "fused" if cuda else "default"
    except (TypeError, RuntimeError):  # no fused AdamW in this PyTorch
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
        result["adamw"] = "default"
    step_model = torch.compile(model) if a.mode == "compile" else model

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    pieces = list(zip(x.chunk(a.micro_batches), y.chunk(a.micro_batches)))

    def step():
        total = 0.0
        for xs, ys in pieces:  # one piece: the whole batch's step, as without accumulation
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = step_model(xs, ys)
            (loss / a.micro_batches if a.micro_batches > 1 else loss).backward()
            total = total + loss.detach()
        loss = total / a.micro_batches
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss, norm

    try:
        sync()
        start = time.perf_counter()
        for _ in range(a.warmup):
            loss, norm = step()
        sync()
        result["warmup_s"] = time.perf_counter() - start
        seconds = []
        for _ in range(a.steps):
            sync()
            t0 = time.perf_counter()
            loss, norm = step()
            sync()
            seconds.append(time.perf_counter() - t0)
        result["last_loss"] = float(loss)
        result["last_grad_norm"] = float(norm)  # before clipping
    except Exception as e:  # noqa: BLE001 - reported, not hidden: out of memory, a compiler error, ...
        result["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        if cuda:
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        finish(1)
    median = statistics.median(seconds)
    result.update(step_s_median=median, step_s_mean=statistics.mean(seconds), step_s_min=min(seconds),
                  samples_per_s=a.batch_size / median)
    if lm:
        result["tokens_per_s"] = a.batch_size * a.seq_len / median
    if cuda:
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    finish(0)


if __name__ == "__main__":
    main()
