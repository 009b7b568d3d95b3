"""Forward and backward pass of a dense decoder with LoRA on its projections, in numpy.

The base weights are frozen: the backward pass carries the gradient through them (dx = dy W)
but computes weight gradients only for the LoRA factors. Everything runs in the dtype of the
`FrozenBase` — float32 for training, float64 for gradient checks — on plain numpy/BLAS, with
no activation rounding (training wants the exact function, not llama.cpp's arithmetic).

The loss is the summed cross-entropy of the target tokens, times `weight` (the trainer passes
1 / target tokens in the optimizer step, so a step's loss is the per-token mean).

Shapes: T tokens, n = n_embd, H query heads and Hkv KV heads of d dims, G = H / Hkv.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import blas_threads
from ..arch.parts import BiasedAttention, NormedAttention
from ..lora import TRAINABLE_ARCHS, AdapterError


@dataclass
class BaseLayer:
    attn_norm: np.ndarray
    ffn_norm: np.ndarray
    w: dict                         # target ("attn_q", ...) -> dense (n_out, n_in)
    names: dict                     # target -> base tensor name
    bias: dict | None = None        # qwen2: "attn_q"/"attn_k"/"attn_v" -> (n_out,)
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None


class FrozenBase:
    """Dense copies of a model's weights in `dtype` (float32 shares the engine's copies)."""

    def __init__(self, model, dtype=np.float32):
        c = model.config
        if c.arch not in TRAINABLE_ARCHS or c.is_moe:
            raise AdapterError(f"LoRA training supports dense {', '.join(TRAINABLE_ARCHS)} models; "
                               f"{model.path.name} is {c.arch}{' (MoE)' if c.is_moe else ''}")
        self.config, self.dtype = c, np.dtype(dtype)
        cast = lambda a: np.ascontiguousarray(a, self.dtype)  # noqa: E731
        self.embd = cast(model.token_embd.dense)
        self.out = self.embd if model.tied_output else cast(model.output.dense)
        self.out_norm = cast(model.output_norm)
        self.layers = []
        for L in model.layers:
            a, f = L.attn, L.ffn
            mats = {"attn_q": a.wq, "attn_k": a.wk, "attn_v": a.wv, "attn_output": a.wo,
                    "ffn_gate": f.gate, "ffn_up": f.up, "ffn_down": f.down}
            bl = BaseLayer(cast(L.attn_norm), cast(L.ffn_norm), {k: cast(w.dense) for k, w in mats.items()},
                           {k: w.name for k, w in mats.items()})
            if isinstance(a, BiasedAttention):                   # qwen2
                bl.bias = {"attn_q": cast(a.bq), "attn_k": cast(a.bk), "attn_v": cast(a.bv)}
            if isinstance(a, NormedAttention):                   # qwen3: per head
                bl.q_norm, bl.k_norm = cast(a.q_norm), cast(a.k_norm)
            self.layers.append(bl)
        half = c.rope_dim // 2
        self.inv_freq = 1.0 / (c.rope_base ** (np.arange(0, c.rope_dim, 2, dtype=np.float64) / c.rope_dim))
        assert len(self.inv_freq) == half

    def rope(self, T: int):
        ang = np.outer(np.arange(T, dtype=np.float64) / self.config.rope_scale, self.inv_freq)
        return np.cos(ang).astype(self.dtype), np.sin(ang).astype(self.dtype)


# -- pieces and their derivatives ------------------------------------------------------------

def _norm_fwd(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * r * w, r


def _norm_bwd(dy, x, r, w):
    g = dy * w
    return r * g - x * (r ** 3) * np.mean(g * x, axis=-1, keepdims=True)


def _rope(x, cos, sin, style):
    """Rotate x (T, heads, d) over its first rope dims; returns a new array. The inverse
    (the backward pass) is the same rotation with -sin."""
    half = cos.shape[1]
    c, s = cos[:, None, :], sin[:, None, :]
    y = x.copy()
    if style == "normal":
        a, b = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2] = a * c - b * s
        y[..., 1:2 * half:2] = a * s + b * c
    else:
        a, b = x[..., :half], x[..., half:2 * half]
        y[..., :half] = a * c - b * s
        y[..., half:2 * half] = a * s + b * c
    return y


class _Linear:
    """y = a W^T + scale (a A^T) B^T, remembering what the backward pass needs."""

    def __init__(self, W, ab, scale):
        self.W, self.ab, self.scale = W, ab, scale

    def fwd(self, a):
        self.a = a
        y = a @ self.W.T
        if self.ab is not None:
            A, B = self.ab
            self.t = a @ A.T
            y += self.scale * (self.t @ B.T)
        return y

    def bwd(self, dy, grad):
        da = dy @ self.W
        if self.ab is not None:
            A, B = self.ab
            dt = self.scale * (dy @ B)                       # (T, r)
            if grad is not None:
                grad[1][...] += self.scale * (dy.T @ self.t)  # dB (n_out, r)
                grad[0][...] += dt.T @ self.a                  # dA (r, n_in)
            da += dt @ A
        self.a = self.t = None
        return da


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


@blas_threads.all_threads()       # numpy-bound: every BLAS thread (the engine keeps one)
def loss_and_grads(base: FrozenBase, lora: dict, scale: float, tokens, targets, grads: dict,
                   weight=1.0) -> tuple[float, int]:
    """Cross-entropy of predicting tokens[j] at position j - 1 for every j in `targets`.

    `lora` maps base tensor names to (A, B) in base.dtype; LoRA gradients are *added* into
    `grads` (same keys and shapes), scaled by `weight`. Returns (summed loss, target count).

    `weight` may instead be a function of the targets' log-probabilities returning (one weight
    per target, the objective's value): the gradient is then that of sum_t w_t * (-log p_t),
    with the weights taken as constants — how policy-gradient objectives (GRPO) reuse this
    backward pass."""
    c, dt = base.config, base.dtype
    tokens = np.asarray(tokens)
    targets = np.asarray(sorted(targets), dtype=np.int64)
    if len(targets) == 0:
        return 0.0, 0
    if targets[0] < 1:
        raise ValueError("the first token has no prediction to learn from")
    T, H, Hkv, d = len(tokens), c.n_head, c.n_head_kv, c.head_dim
    G = H // Hkv
    cos, sin = base.rope(T)
    inv = dt.type(1.0 / np.sqrt(d))
    causal = np.triu(np.ones((T, T), bool), 1)
    x = base.embd[tokens].astype(dt)
    tape = []
    for L in base.layers:
        lin = {k: _Linear(L.w[k], lora.get(L.names[k]), scale) for k in L.w}
        s = {"lin": lin, "x0": x}
        a, s["r1"] = _norm_fwd(x, L.attn_norm, c.rms_eps)
        q, k, v = lin["attn_q"].fwd(a), lin["attn_k"].fwd(a), lin["attn_v"].fwd(a)
        if L.bias is not None:
            q, k, v = q + L.bias["attn_q"], k + L.bias["attn_k"], v + L.bias["attn_v"]
        q, k, v = q.reshape(T, H, d), k.reshape(T, Hkv, d), v.reshape(T, Hkv, d)
        if L.q_norm is not None:
            s["q_pre"], s["k_pre"] = q, k
            q, s["rq"] = _norm_fwd(q, L.q_norm, c.rms_eps)
            k, s["rk"] = _norm_fwd(k, L.k_norm, c.rms_eps)
        q, k = _rope(q, cos, sin, c.rope_style), _rope(k, cos, sin, c.rope_style)
        qg = q.reshape(T, Hkv, G, d).transpose(1, 2, 0, 3)                  # (Hkv, G, T, d)
        kk = k.transpose(1, 0, 2)[:, None]                                   # (Hkv, 1, T, d)
        vv = v.transpose(1, 0, 2)[:, None]
        S = (qg @ kk.swapaxes(-1, -2)) * inv
        S[..., causal] = -np.inf
        S -= S.max(axis=-1, keepdims=True)
        P = np.exp(S)
        P /= P.sum(axis=-1, keepdims=True)
        o = (P @ vv).transpose(2, 0, 1, 3).reshape(T, H * d)
        s.update(qg=qg, kk=kk, vv=vv, P=P)
        x = x + lin["attn_output"].fwd(o)
        s["x1"] = x
        f, s["r2"] = _norm_fwd(x, L.ffn_norm, c.rms_eps)
        g, u = lin["ffn_gate"].fwd(f), lin["ffn_up"].fwd(f)
        sg = _sigmoid(g)
        s.update(g=g, u=u, sg=sg)
        x = x + lin["ffn_down"].fwd(g * sg * u)
        tape.append(s)

    # the head: only the rows that predict a target
    rows = targets - 1
    n, r_out = _norm_fwd(x, base.out_norm, c.rms_eps)
    logits = n[rows] @ base.out.T                                            # (R, V)
    logits -= logits.max(axis=-1, keepdims=True)
    p = np.exp(logits)
    z = p.sum(axis=-1, keepdims=True)
    y = tokens[targets]
    logp = logits[np.arange(len(rows)), y] - np.log(z[:, 0])
    p /= z
    p[np.arange(len(rows)), y] -= 1.0
    if callable(weight):
        w, loss = weight(logp.astype(np.float64))
        p *= np.asarray(w, dt)[:, None]
    else:
        loss = float(-np.sum(logp))
        p *= dt.type(weight)
    dn = np.zeros_like(x)
    dn[rows] = p @ base.out
    del logits, p
    dx = _norm_bwd(dn, x, r_out, base.out_norm)

    for L, s in zip(reversed(base.layers), reversed(tape)):
        lin = s["lin"]
        gr = lambda k: grads.get(L.names[k])  # noqa: E731  (None where a target has no LoRA)
        # FFN
        dh = lin["ffn_down"].bwd(dx, gr("ffn_down"))
        g, u, sg = s["g"], s["u"], s["sg"]
        silu = g * sg
        du = dh * silu
        dg = dh * u * (sg * (1.0 + g * (1.0 - sg)))
        df = lin["ffn_gate"].bwd(dg, gr("ffn_gate")) + lin["ffn_up"].bwd(du, gr("ffn_up"))
        dx = dx + _norm_bwd(df, s["x1"], s["r2"], L.ffn_norm)
        # attention
        do = lin["attn_output"].bwd(dx, gr("attn_output"))
        qg, kk, vv, P = s["qg"], s["kk"], s["vv"], s["P"]
        dO = do.reshape(T, Hkv, G, d).transpose(1, 2, 0, 3)
        dP = dO @ vv.swapaxes(-1, -2)
        dV = (P.swapaxes(-1, -2) @ dO).sum(axis=1)                           # (Hkv, T, d)
        dS = P * (dP - np.sum(dP * P, axis=-1, keepdims=True)) * inv
        dq = (dS @ kk).transpose(2, 0, 1, 3).reshape(T, H, d)
        dk = (dS.swapaxes(-1, -2) @ qg).sum(axis=1).transpose(1, 0, 2)       # (T, Hkv, d)
        dv = dV.transpose(1, 0, 2)
        dq, dk = _rope(dq, cos, -sin, c.rope_style), _rope(dk, cos, -sin, c.rope_style)
        if L.q_norm is not None:
            dq = _norm_bwd(dq, s["q_pre"], s["rq"], L.q_norm)
            dk = _norm_bwd(dk, s["k_pre"], s["rk"], L.k_norm)
        da = (lin["attn_q"].bwd(dq.reshape(T, H * d), gr("attn_q"))
              + lin["attn_k"].bwd(dk.reshape(T, Hkv * d), gr("attn_k"))
              + lin["attn_v"].bwd(np.ascontiguousarray(dv).reshape(T, Hkv * d), gr("attn_v")))
        dx = dx + _norm_bwd(da, s["x0"], s["r1"], L.attn_norm)
    return loss, len(targets)

