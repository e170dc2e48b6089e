"""mpipe's models in PyTorch, layer for layer and name for name: the reference twin used
by tests/reference/check_reference.py and the PyTorch side of scripts/bench_cpu.sh.

Global layer indices and parameter names follow mpipe's: GPT is layer 0 embedding,
1..N blocks, N+1 final LayerNorm, N+2 the head tied to wte; Llama the same list with
RMSNorms, RoPE, grouped-query attention and SwiGLU, its head its own matrix or wte; the
MLP is Linear/ReLU pairs then the output Linear. named() maps (layer, name) to the torch
parameter.
"""
import math

import torch
import torch.nn.functional as F


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
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, idx):
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
        return self.ln_f(x) @ self.wte.t()


class Conv1D(torch.nn.Module):
    """Hugging Face GPT-2's Conv1D: a linear map whose weight is stored [in, out]."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = torch.nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class GPT2HF(torch.nn.Module):
    """GPT-2 in Hugging Face's layout (GPT2LMHeadModel's parameter names and its Conv1D
    weights), written here: what `mpipe export` writes for the GPT preset loads into it
    with strict=True. The LM head is the token table (tied), as in GPT-2."""

    def __init__(self, n_layer, C, H, T, V):
        super().__init__()
        self.H = H
        t = self.transformer = torch.nn.Module()
        t.wte = torch.nn.Embedding(V, C)
        t.wpe = torch.nn.Embedding(T, C)
        t.h = torch.nn.ModuleList()
        for _ in range(n_layer):
            b = torch.nn.Module()
            b.ln_1 = torch.nn.LayerNorm(C, eps=1e-5)
            b.attn = torch.nn.Module()
            b.attn.c_attn, b.attn.c_proj = Conv1D(C, 3 * C), Conv1D(C, C)
            b.ln_2 = torch.nn.LayerNorm(C, eps=1e-5)
            b.mlp = torch.nn.Module()
            b.mlp.c_fc, b.mlp.c_proj = Conv1D(C, 4 * C), Conv1D(4 * C, C)
            t.h.append(b)
        t.ln_f = torch.nn.LayerNorm(C, eps=1e-5)

    def logits(self, idx):
        B, T = idx.shape
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(T))
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        for b in t.h:
            q, k, v = b.attn.c_attn(b.ln_1(x)).split(x.shape[-1], dim=2)
            hs = x.shape[-1] // self.H
            q, k, v = (u.view(B, T, self.H, hs).transpose(1, 2) for u in (q, k, v))
            att = ((q @ k.transpose(-2, -1)) / math.sqrt(hs)).masked_fill(mask, float("-inf")).softmax(dim=-1)
            x = x + b.attn.c_proj((att @ v).transpose(1, 2).contiguous().view(B, T, -1))
            x = x + b.mlp.c_proj(F.gelu(b.mlp.c_fc(b.ln_2(x)), approximate="tanh"))
        return t.ln_f(x) @ t.wte.weight.t()


    @torch.no_grad()
    def decode(self, idx, cache, position):
        """The logits (V) of the last of the new tokens idx (1, t) at positions [position,
        position + t), with Hugging Face's use_cache: per block a (2, 1, H, context, hs)
        tensor of the keys and values so far, which takes the new ones."""
        B, t = idx.shape
        tr = self.transformer
        end = position + t
        x = tr.wte(idx) + tr.wpe(torch.arange(position, end, device=idx.device))
        C = x.shape[-1]
        hs = C // self.H
        mask = torch.ones(t, end, dtype=torch.bool, device=idx.device).triu(diagonal=position + 1) if t > 1 else None
        for b, kv in zip(tr.h, cache):
            q, k, v = b.attn.c_attn(b.ln_1(x)).split(C, dim=2)
            q, k, v = (u.view(B, t, self.H, hs).transpose(1, 2) for u in (q, k, v))
            kv[0, :, :, position:end] = k
            kv[1, :, :, position:end] = v
            att = (q @ kv[0, :, :, :end].transpose(-2, -1)) / math.sqrt(hs)
            if mask is not None:
                att = att.masked_fill(mask, float("-inf"))
            y = att.softmax(dim=-1) @ kv[1, :, :, :end]
            x = x + b.attn.c_proj(y.transpose(1, 2).reshape(B, t, C))
            x = x + b.mlp.c_proj(F.gelu(b.mlp.c_fc(b.ln_2(x)), approximate="tanh"))
        return (tr.ln_f(x[:, -1]) @ tr.wte.weight.t())[0]

    @torch.no_grad()
    def generate_greedy(self, prompt, n):
        """`mpipe generate --temperature 0`'s loop (greedy_loop) over decode. Returns the n
        new tokens."""
        w = self.transformer.wte.weight  # its device and type are the loop's
        T, C = self.transformer.wpe.weight.shape[0], w.shape[1]
        cache = [torch.zeros(2, 1, self.H, T, C // self.H, device=w.device, dtype=w.dtype) for _ in self.transformer.h]
        return greedy_loop(lambda ids, position: self.decode(ids, cache, position), T, w.device, prompt, n)


def greedy_loop(decode, T, device, prompt, n):
    """`mpipe generate --temperature 0`'s loop: the prompt (its last context's worth), then
    a token a step with the cache; with the context full, the last half of the tokens again
    from position 0. decode(ids (1, t), position) gives the logits (V) of the last of them.
    Returns the n new tokens."""
    tokens = list(prompt)
    count = min(len(tokens), T)
    ids = lambda n: torch.tensor([tokens[-n:]], device=device)  # noqa: E731
    logits = decode(ids(count), 0)
    position = count
    for i in range(n):
        tokens.append(int(torch.argmax(logits)))
        if i + 1 == n:
            break
        if position == T:
            count = T // 2 + T % 2
            logits = decode(ids(count), 0)
            position = count
        else:
            logits = decode(ids(1), position)
            position += 1
    return tokens[len(prompt):]


def llama_ffn(C):
    """mpipe's --ffn 0: Llama's rule, int(8C / 3) rounded up to a multiple of 256."""
    return (8 * C // 3 + 255) // 256 * 256


class Llama(torch.nn.Module):
    """The Llama family as mpipe builds it (--model llama): layer 0 the token table (no
    positions), 1..N pre-RMSNorm blocks (RoPE on q and k, grouped-query attention, SwiGLU,
    no biases), N+1 the final RMSNorm, N+2 the head (its own matrix, or wte with tie), N+3
    the loss; parameters named as in mpipe. c_attn's rows are q (H heads), k, v (KVH heads
    each); c_fc's are gate, then up. dtype: float32 as mpipe, or float64 (the reference
    test's exact side); RoPE's angles are float64 either way."""

    def __init__(self, n_layer, C, H, T, V, kv_heads=0, ffn=0, rope_theta=10000.0, eps=1e-5, tie=False,
                 dtype=torch.float32):
        super().__init__()
        self.H, self.KVH, self.T, self.eps = H, kv_heads or H, T, eps
        self.F = ffn or llama_ffn(C)
        hs = C // H
        assert C % H == 0 and H % self.KVH == 0 and hs % 2 == 0
        kw = {"dtype": dtype}
        self.wte = torch.nn.Parameter(torch.zeros(V, C, **kw))
        self.blocks = torch.nn.ModuleList()
        for _ in range(n_layer):
            b = torch.nn.Module()
            b.ln_1 = torch.nn.Parameter(torch.ones(C, **kw))
            b.c_attn = torch.nn.Linear(C, (H + 2 * self.KVH) * hs, bias=False, **kw)
            b.c_proj = torch.nn.Linear(C, C, bias=False, **kw)
            b.ln_2 = torch.nn.Parameter(torch.ones(C, **kw))
            b.c_fc = torch.nn.Linear(C, 2 * self.F, bias=False, **kw)
            b.mlp_proj = torch.nn.Linear(self.F, C, bias=False, **kw)
            self.blocks.append(b)
        self.ln_f = torch.nn.Parameter(torch.ones(C, **kw))
        self.head = None if tie else torch.nn.Parameter(torch.zeros(V, C, **kw))
        # angle p · theta^(-2i/hs) of position p, pair i: float64, then the model's type.
        i = torch.arange(hs // 2, dtype=torch.float64)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * torch.pow(float(rope_theta), -2.0 * i / hs)
        self.register_buffer("cos", angle.cos().to(dtype), persistent=False)  # (T, hs/2)
        self.register_buffer("sin", angle.sin().to(dtype), persistent=False)

    def named(self):
        """(global layer, mpipe name) -> torch parameter."""
        n = len(self.blocks)
        out = {(0, "wte"): self.wte}
        for i, b in enumerate(self.blocks):
            for name, p in [("ln_1.weight", b.ln_1), ("attn.c_attn.weight", b.c_attn.weight),
                            ("attn.c_proj.weight", b.c_proj.weight), ("ln_2.weight", b.ln_2),
                            ("mlp.c_fc.weight", b.c_fc.weight), ("mlp.c_proj.weight", b.mlp_proj.weight)]:
                out[(1 + i, name)] = p
        out[(n + 1, "weight")] = self.ln_f
        if self.head is not None:
            out[(n + 2, "weight")] = self.head
        return out

    def rms(self, x, weight):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * weight

    def rope(self, u, position):
        """u (B, heads, t, hs) at positions [position, position + t): pair i with i + hs/2."""
        t, half = u.shape[2], u.shape[3] // 2
        cos, sin = self.cos[position:position + t], self.sin[position:position + t]
        u1, u2 = u[..., :half], u[..., half:]
        return torch.cat([u1 * cos - u2 * sin, u2 * cos + u1 * sin], dim=-1)

    def qkv(self, b, x, position):
        """The block's rotated queries (B, H, t, hs), keys and values (B, KVH, t, hs)."""
        B, t, C = x.shape
        hs = C // self.H
        q, k, v = b.c_attn(self.rms(x, b.ln_1)).split([C, self.KVH * hs, self.KVH * hs], dim=2)
        q = q.view(B, t, self.H, hs).transpose(1, 2)
        k, v = (u.view(B, t, self.KVH, hs).transpose(1, 2) for u in (k, v))
        return self.rope(q, position), self.rope(k, position), v

    def attend(self, b, x, q, k, v, mask):
        """x plus the attention of q over k, v (query head h reads key/value head
        h // (H / KVH)), then x plus the SwiGLU MLP."""
        B, t, C = x.shape
        group = self.H // self.KVH
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
        if mask is not None:
            att = att.masked_fill(mask, float("-inf"))
        x = x + b.c_proj((att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, t, C))
        gate, up = b.c_fc(self.rms(x, b.ln_2)).split(self.F, dim=-1)
        return x + b.mlp_proj(F.silu(gate) * up)

    def head_of(self, x):
        return self.rms(x, self.ln_f) @ (self.wte if self.head is None else self.head).t()

    def forward(self, idx, targets):
        logits = self.logits(idx)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, idx):
        T = idx.shape[1]
        x = self.wte[idx]
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), diagonal=1)
        for b in self.blocks:
            x = self.attend(b, x, *self.qkv(b, x, 0), mask)
        return self.head_of(x)

    @torch.no_grad()
    def decode(self, idx, cache, position):
        """The logits (V) of the last of the new tokens idx (1, t) at positions [position,
        position + t), with a key/value cache: per block a (2, 1, KVH, context, hs) tensor
        of the rotated keys and the values so far, which takes the new ones."""
        t = idx.shape[1]
        end = position + t
        x = self.wte[idx]
        mask = torch.ones(t, end, dtype=torch.bool, device=idx.device).triu(diagonal=position + 1) if t > 1 else None
        for b, kv in zip(self.blocks, cache):
            q, k, v = self.qkv(b, x, position)
            kv[0, :, :, position:end] = k
            kv[1, :, :, position:end] = v
            x = self.attend(b, x, q, kv[0, :, :, :end], kv[1, :, :, :end], mask)
        return self.head_of(x[:, -1])[0]

    @torch.no_grad()
    def generate_greedy(self, prompt, n):
        """`mpipe generate --temperature 0`'s loop (greedy_loop) with the key/value cache.
        Returns the n new tokens."""
        w = self.wte
        hs = w.shape[1] // self.H
        cache = [torch.zeros(2, 1, self.KVH, self.T, hs, device=w.device, dtype=w.dtype) for _ in self.blocks]
        return greedy_loop(lambda ids, position: self.decode(ids, cache, position), self.T, w.device, prompt, n)


def read_safetensors(path, dtypes=None):
    """A safetensors file's tensors {name: numpy array} and its metadata, read with numpy
    alone (the format: an 8-byte length, a JSON header, raw little-endian data): F32 and
    I64 as they are, F16 and BF16 widened exactly to float32. `dtypes`, a dict, gets each
    tensor's dtype as the file names it."""
    import json
    import struct

    import numpy as np
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        raw = np.frombuffer(data[b:e], dtype={"F32": "<f4", "I64": "<i8", "F16": "<f2", "BF16": "<u2"}[t["dtype"]])
        if t["dtype"] == "BF16":  # the high half of a float32
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F16":
            raw = raw.astype(np.float32)
        out[name] = raw.reshape(t["shape"]).copy()
        if dtypes is not None:
            dtypes[name] = t["dtype"]
    return out, meta


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


class Sequential(torch.nn.Module):
    """A model file's layer list (mpipe --model FILE) for the layer kinds that need no
    sequence: the convolutional ones, residual blocks, linear, layernorm, activations,
    flatten, upsampling and skips (a layer's `stash`, a later concat's or add's `from`).
    Parameters are keyed (layer index, name) as in mpipe's checkpoints."""

    def __init__(self, spec, micro_batches=1, batchnorm="micro"):
        super().__init__()
        self.micro_batches = micro_batches  # BatchNorm: statistics per micro-batch, in order
        self.kinds, self.parts, self.layers = [], torch.nn.ModuleList(), repeated(spec["layer"])
        self.deferred = batchnorm == "deferred"
        x, stashed = torch.zeros(1, *spec["input"]), {}
        for layer in self.layers:
            if layer["kind"] in ("concat", "add"):
                part, x = None, join(layer, x, stashed)
            else:
                part, x = build_part(layer, x)
            if "stash" in layer:
                stashed[layer["stash"]] = x
            self.kinds.append(layer["kind"])
            self.parts.append(part if part is not None else torch.nn.Identity())
        # --batchnorm deferred (torchgpipe's DeferredBatchNorm, with PyTorch's unbiased
        # variance): each micro-batch is normalised with its own statistics, but the
        # running ones move once per step, toward the whole mini-batch's (apply_deferred).
        self.seen = {}
        if self.deferred:
            for bn in self.modules():
                if isinstance(bn, torch.nn.BatchNorm2d):
                    bn.deferred_momentum, bn.momentum = bn.momentum, 0.0
                    bn.register_forward_pre_hook(self._gather)

    def _gather(self, bn, inputs):
        if bn.training:
            self.seen.setdefault(bn, []).append(inputs[0].detach())

    def apply_deferred(self, keep=True):
        """Moves the running statistics toward the step's whole batch (keep=False: drops it)."""
        with torch.no_grad():
            for bn, xs in self.seen.items():
                if not keep:
                    continue
                x = torch.cat(xs)
                m = bn.deferred_momentum
                bn.running_mean.mul_(1 - m).add_(m * x.mean(dim=(0, 2, 3)))
                bn.running_var.mul_(1 - m).add_(m * x.var(dim=(0, 2, 3), unbiased=True))
        self.seen = {}

    def named(self):
        """Parameters and BatchNorm's running statistics, keyed as mpipe's checkpoints."""
        out = {}
        for i, part in enumerate(self.parts):
            names = part.mpipe_named() if isinstance(part, Residual) else state_of(part)
            out.update({(i, name): p for name, p in names.items()})
        return out

    def forward(self, x, targets):
        # As the pipeline: micro-batch by micro-batch (BatchNorm sees each alone), the
        # loss the mean over every row.
        # A label per pixel: (N, classes, H, W) against (N, H, W), the mean over pixels too.
        total = 0.0
        for xs, ts in zip(x.chunk(self.micro_batches), targets.chunk(self.micro_batches)):
            stashed = {}
            for layer, kind, part in zip(self.layers, self.kinds, self.parts):
                if kind in ("concat", "add"):
                    xs = join(layer, xs, stashed)
                elif kind != "cross_entropy":
                    xs = part(xs)
                if "stash" in layer:
                    stashed[layer["stash"]] = xs
            total = total + F.cross_entropy(xs, ts.long(), reduction="sum")
        return total / targets.numel()


def state_of(part):
    """A module's parameters and running statistics (not num_batches_tracked)."""
    names = dict(part.named_parameters())
    names.update({n: b for n, b in part.named_buffers() if n.startswith("running_")})
    return names


def repeated(layers):
    """A model file's list with each layer's `repeat` unrolled, as mpipe reads it."""
    return [layer for layer in layers for _ in range(layer.get("repeat", 1))]


class Residual(torch.nn.Module):
    """mpipe's residual block: inner layers plus the identity or a bias-free projection
    (a 1x1 convolution with the stride that maps the plane, or a linear map), with
    skip-norm a BatchNorm after it."""

    def __init__(self, layer, x):
        super().__init__()
        self.inner = torch.nn.ModuleList()
        h = x
        for child in repeated(layer["layer"]):
            part, h = build_part(child, h)
            self.inner.append(part)
        self.skip = self.skip_norm = None
        if h.shape != x.shape or layer.get("skip", "auto") == "projection":
            if x.dim() == 4:
                stride = next(s for s in range(1, x.shape[2] + 1)
                              if (x.shape[2] - 1) // s + 1 == h.shape[2] and (x.shape[3] - 1) // s + 1 == h.shape[3])
                self.skip = torch.nn.Conv2d(x.shape[1], h.shape[1], 1, stride, 0, bias=False)
                if layer.get("skip-norm", False):
                    self.skip_norm = torch.nn.BatchNorm2d(h.shape[1])
            else:
                self.skip = torch.nn.Linear(x.shape[-1], h.shape[-1], bias=False)

    def mpipe_named(self):
        out = {}
        for j, part in enumerate(self.inner):
            out.update({f"{j}.{name}": p for name, p in state_of(part).items()})
        if self.skip is not None:
            out.update({f"skip.{name}": p for name, p in self.skip.named_parameters()})
        if self.skip_norm is not None:
            out.update({f"skip_norm.{name}": p for name, p in state_of(self.skip_norm).items()})
        return out

    def forward(self, x):
        h = x
        for part in self.inner:
            h = part(h)
        if self.skip is None:
            return h + x
        s = self.skip(x)
        return h + (self.skip_norm(s) if self.skip_norm is not None else s)


def join(layer, x, stashed):
    """A skip's join: the stashed tensor `from` concatenated along the channels (dim 1 of
    images, else the last) or added."""
    skip = stashed[layer["from"]]
    if layer["kind"] == "add":
        return x + skip
    return torch.cat([x, skip], dim=1 if x.dim() == 4 else -1)


class GlobalAvgPool(torch.nn.Module):
    def forward(self, x):
        return x.mean(dim=(2, 3))


def build_part(layer, x):
    """The torch module of one mpipe layer spec (None for the loss), and x through it."""
    kind = layer["kind"]
    get = layer.get
    if kind == "conv2d":
        part = torch.nn.Conv2d(x.shape[1], get("out"), get("kernel"), get("stride", 1), get("padding", 0),
                               groups=get("groups", 1), bias=get("bias", True))
    elif kind in ("maxpool2d", "avgpool2d"):
        k, s, p = get("kernel"), get("stride", 0) or get("kernel"), get("padding", 0)
        part = torch.nn.MaxPool2d(k, s, p) if kind == "maxpool2d" else torch.nn.AvgPool2d(k, s, p, count_include_pad=True)
    elif kind == "upsample2d":
        part = torch.nn.Upsample(scale_factor=get("scale", 2), mode="nearest")
    elif kind == "global-avgpool":
        part = GlobalAvgPool()
    elif kind == "flatten":
        part = torch.nn.Flatten()
    elif kind == "linear":
        part = torch.nn.Linear(x.shape[-1], get("out"), bias=get("bias", True))
    elif kind == "batchnorm2d":
        part = torch.nn.BatchNorm2d(x.shape[1], eps=get("eps", 1e-5), momentum=get("momentum", 0.1))
        if get("zero-init", False):
            torch.nn.init.zeros_(part.weight)
    elif kind == "layernorm":
        part = torch.nn.LayerNorm(x.shape[-1], eps=1e-5)
    elif kind == "relu":
        part = torch.nn.ReLU()
    elif kind == "gelu":
        part = torch.nn.GELU(approximate="tanh")
    elif kind == "residual":
        part = Residual(layer, x)
    elif kind == "cross_entropy":
        return None, x
    else:
        raise ValueError(f"kind {kind} has no torch twin here")
    with torch.no_grad():  # the shape only: no running statistics moved
        training = part.training
        part.eval()
        y = part(x)
        part.train(training)
    return part, y
