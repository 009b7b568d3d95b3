"""Make tests/data/lora_torch_<model>.npz: one LoRA training step in float64 PyTorch.

An independent re-implementation of the dense decoder (weights read with the `gguf` package,
not Kiln's loader), autograd for the gradients and torch.optim.AdamW for the step. The test
(tests/test_lora_grad.py) checks Kiln's loss, every LoRA gradient and the updated factors
against it, so it runs without torch. Regenerate with (torch 2.13.0, CPU):

    python tests/tools/torch_lora_reference.py ../shared/reference/tiny/tiny-llama.gguf tests/data/
"""

import sys
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
RANK, ALPHA, LR, BETAS, EPS, WD = 4, 8.0, 1e-2, (0.9, 0.999), 1e-8, 0.01


def field(r, key):
    f = r.fields[key]
    v = f.parts[f.data[0]]
    return v.tobytes().decode() if f.types[0].name == "STRING" else v.item()


def main(path: str, out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    r = GGUFReader(path)
    arch = field(r, "general.architecture")
    W = {t.name: torch.tensor(dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape)]),
                              dtype=torch.float64) for t in r.tensors}
    n_layer, n_head = field(r, f"{arch}.block_count"), field(r, f"{arch}.attention.head_count")
    n_kv, eps = field(r, f"{arch}.attention.head_count_kv"), field(r, f"{arch}.attention.layer_norm_rms_epsilon")
    base = field(r, f"{arch}.rope.freq_base")
    n_embd = field(r, f"{arch}.embedding_length")
    d = n_embd // n_head
    neox = arch != "llama"

    rng = np.random.default_rng(1234)
    tokens = rng.integers(0, W["token_embd.weight"].shape[0] - 30, size=16)
    targets = np.array([5, 6, 7, 8, 12, 13, 14, 15])
    lora = {}
    for i in range(n_layer):
        for t in TARGETS:
            n = f"blk.{i}.{t}.weight"
            n_out, n_in = W[n].shape
            lora[n] = (torch.tensor(rng.uniform(-1, 1, (RANK, n_in)) / np.sqrt(n_in), requires_grad=True),
                       torch.tensor(rng.normal(0, 0.05, (n_out, RANK)), requires_grad=True))
    init = {n: (a.detach().numpy().copy(), b.detach().numpy().copy()) for n, (a, b) in lora.items()}
    scale = ALPHA / RANK

    def lin(x, name):
        a, b = lora[name]
        return x @ W[name].T + scale * (x @ a.T) @ b.T

    def norm(x, w):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w

    T = len(tokens)
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.outer(pos, inv)
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

    def rope(x):
        if neox:
            a, b = x[..., :d // 2], x[..., d // 2:]
            return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)

    x = W["token_embd.weight"][torch.tensor(tokens)]
    for i in range(n_layer):
        p = f"blk.{i}."
        h = norm(x, W[p + "attn_norm.weight"])
        q, k, v = lin(h, p + "attn_q.weight"), lin(h, p + "attn_k.weight"), lin(h, p + "attn_v.weight")
        if p + "attn_q.bias" in W:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q, k, v = q.reshape(T, n_head, d), k.reshape(T, n_kv, d), v.reshape(T, n_kv, d)
        if p + "attn_q_norm.weight" in W:
            q, k = norm(q, W[p + "attn_q_norm.weight"]), norm(k, W[p + "attn_k_norm.weight"])
        q, k = rope(q), rope(k)
        k = k.repeat_interleave(n_head // n_kv, dim=1)
        v = v.repeat_interleave(n_head // n_kv, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) / np.sqrt(d)
        s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v).reshape(T, n_embd)
        x = x + lin(o, p + "attn_output.weight")
        h = norm(x, W[p + "ffn_norm.weight"])
        x = x + lin(torch.nn.functional.silu(lin(h, p + "ffn_gate.weight")) * lin(h, p + "ffn_up.weight"),
                    p + "ffn_down.weight")
    out_w = W.get("output.weight", W["token_embd.weight"])
    logits = norm(x, W["output_norm.weight"]) @ out_w.T
    tg = torch.tensor(targets)
    loss = torch.nn.functional.cross_entropy(logits[tg - 1], torch.tensor(tokens)[tg], reduction="mean")
    loss.backward()
    params = [t for ab in lora.values() for t in ab]
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    grads = {n: (a.grad.numpy().copy(), b.grad.numpy().copy()) for n, (a, b) in lora.items()}
    opt.step()
    out = {"tokens": tokens, "targets": targets, "loss": np.float64(loss.item()),
           "hyper": np.array([RANK, ALPHA, LR, BETAS[0], BETAS[1], EPS, WD])}
    for n in lora:
        out[n + "|a0"], out[n + "|b0"] = init[n]
        out[n + "|ga"], out[n + "|gb"] = grads[n]
        out[n + "|a1"], out[n + "|b1"] = lora[n][0].detach().numpy(), lora[n][1].detach().numpy()
    dest = Path(out_dir) / f"lora_torch_{Path(path).stem}.npz"
    np.savez_compressed(dest, **out)
    print(f"{dest}: loss {loss.item():.12f} (torch {torch.__version__})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
