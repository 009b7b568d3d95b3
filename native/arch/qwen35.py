"""qwen35 / qwen35moe (Qwen3.5): hybrid layers. Every `full_attention_interval`-th layer is gated
full attention; the others are gated delta nets (linear attention with a recurrent state).

    layer:  x + mixer(norm(x))  →  x + ffn(post_attention_norm(x))      (ffn: SwiGLU, or routed
                                                                         experts + sigmoid-gated shared expert)
    full attention:  attn_q gives per head 64 query rows then 64 gate rows; q/k RMSNorm per
        head; rope (rotate-half) on the first rope.dimension_count dims — IMRoPE's sections all
        see the text position, so it is plain rope there; attention × sigmoid(gate) → attn_output.
    gated delta net:  attn_qkv → causal depthwise conv (kernel ssm.conv_kernel, its last inputs
        kept per sequence) → SiLU → q | k | v; q, k L2-normed per head, value head h reads key
        head h mod n_k_heads; β = sigmoid(ssm_beta·x); g = ssm_a · softplus(ssm_alpha·x + dt_bias);
        the state S (per value head, d_k × d_v) decays by exp(g) and is corrected toward v by β
        (the delta rule); output q·S, RMSNorm per head (ssm_norm) × SiLU(attn_gate·x) → ssm_out.

With the compiled extension every row takes the recurrence in C (csrc/delta_net.c, the one-call
decode's own code: a prompt's bits are those of its tokens stepped one by one); without it, numpy
runs a prompt in chunks of 64 (a triangular solve per chunk, as llama.cpp's chunked path) and a
decode step as the plain recurrence. The recurrent and conv states live in the
sequence's cache; prefix reuse is exact-extension only (a state cannot be rolled back)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import apply_rope, rms_norm
from ..kernels import Weight, compiled_module, sigmoid
from .base import MAX_LAYERS, MAX_WIDTH, Family
from .parts import Layer, NormedAttention, take

F32 = np.float32
CHUNK = 64
DELTA_MAX_WIDTH = 1024     # csrc/delta_net.c's widest head (DELTA_MAX_DV): wider ones take numpy


def _sigmoid(x: np.ndarray) -> np.ndarray:
    """A prompt's delta-net gates (decode rows take the compiled step, csrc/delta_net.c)."""
    return (F32(1) / (F32(1) + np.exp(-x))).astype(F32)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.where(x > F32(20), x, np.log1p(np.exp(np.minimum(x, F32(20))))).astype(F32)


def _l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """ggml_l2_norm over the last axis: squares summed in double, x / max(‖x‖, eps)."""
    s = np.sqrt(np.square(x, dtype=F32).sum(axis=-1, dtype=np.float64, keepdims=True).astype(F32))
    return x * (F32(1) / np.maximum(s, F32(eps)))


@dataclass(kw_only=True)
class GatedAttention(NormedAttention):
    """Full attention whose q projection gives per head the query rows, then gate rows: per-head
    q/k norms, rope, attention × sigmoid(gate) → output."""

    def __call__(self, i, x, b):
        c = b.config
        T, H, D = x.shape[0], c.n_head, c.head_dim
        qg, k, v = b.project_many(x, (self.wq, self.wk, self.wv))     # an adapter on attn_q: both halves
        qg = qg.reshape(T, H, 2, D)
        q, gate = np.ascontiguousarray(qg[:, :, 0]), qg[:, :, 1].reshape(T, H * D)
        q = rms_norm(q, self.q_norm, c.rms_eps)
        k = rms_norm(k.reshape(T, c.n_head_kv, D), self.k_norm, c.rms_eps)
        v = v.reshape(T, c.n_head_kv, D)
        q = apply_rope(q, b.cos, b.sin, c.rope_style)
        k = apply_rope(np.ascontiguousarray(k), b.cos, b.sin, c.rope_style)
        return b.project(b.attend(i, q, k, v) * sigmoid(gate), self.wo)       # the one-call decode's sigmoid


@dataclass(kw_only=True)
class DeltaNet:
    """A gated delta net (linear attention): conv → q, k, v; the delta rule over a recurrent
    state per sequence; its output normed and SiLU-gated → ssm_out."""
    wqkv: Weight
    wgate: Weight
    ssm_beta: Weight
    ssm_alpha: Weight
    ssm_out: Weight
    ssm_conv: np.ndarray
    ssm_dt: np.ndarray
    ssm_a: np.ndarray
    ssm_norm: np.ndarray

    def dims(self, c) -> tuple[int, int, int, int, int]:
        """(key heads, value heads, key width, value width, conv kernel)."""
        Hv = c.get("ssm_v_heads")
        return c.get("ssm_k_heads"), Hv, c.get("ssm_state"), c.get("ssm_inner") // Hv, self.ssm_conv.shape[1]

    def spec(self) -> tuple:
        return self.ssm_conv, self.ssm_dt, self.ssm_a, self.ssm_norm

    def __call__(self, i, x, b):
        c = b.config
        Hk, Hv, dk, dv, K = self.dims(c)
        T = x.shape[0]
        mixed, z, beta_x, alpha_x = b.project_many(x, [self.wqkv, self.wgate, self.ssm_beta, self.ssm_alpha])
        out = np.empty((T, Hv * dv), F32)
        C_ = compiled_module()
        if C_ is not None and max(dk, dv) <= DELTA_MAX_WIDTH and K <= 64 and max(Hk, Hv) <= 4096:
            # the compiled recurrence (csrc/delta_net.c), token after token: the one-call decode's own code
            runs = []
            for cache, a, e in b.segments:
                st = cache.recurrent_state(i)
                runs.append((a, e - a, st["conv"], st["ssm"]))
            C_.delta_rows(self.spec(), (Hk, Hv, dk, dv, K), c.rms_eps, mixed, z, beta_x, alpha_x, runs, out, 0)
            return b.mm(out, self.ssm_out)
        beta = _sigmoid(beta_x)
        g = _softplus(alpha_x + self.ssm_dt) * self.ssm_a                                 # (T, Hv) log-decay
        for cache, a, e in b.segments:            # without the extension: numpy, a prompt in chunks
            st = cache.recurrent_state(i)
            conv_in = np.concatenate([st["conv"], mixed[a:e]])                           # (K-1+T, C)
            st["conv"][:] = conv_in[-st["conv"].shape[0]:] if K > 1 else st["conv"]
            T = e - a
            conv = conv_in[0:T] * self.ssm_conv[:, 0]
            for j in range(1, K):
                conv = conv + conv_in[j:j + T] * self.ssm_conv[:, j]
            conv = conv * _sigmoid(conv)                                                 # SiLU
            q = _l2_norm(conv[:, :Hk * dk].reshape(T, Hk, dk), c.rms_eps)
            k = _l2_norm(conv[:, Hk * dk:2 * Hk * dk].reshape(T, Hk, dk), c.rms_eps)
            v = conv[:, 2 * Hk * dk:].reshape(T, Hv, dv)
            rep = np.arange(Hv) % Hk                                                     # value head h: key head h mod Hk
            q, k = q[:, rep] * F32(1 / np.sqrt(F32(dk))), k[:, rep]
            o = gated_delta_rule(q, k, v, g[a:e], beta[a:e], st["ssm"])
            zs = z[a:e].reshape(T, Hv, dv)
            out[a:e] = (rms_norm(o, self.ssm_norm, c.rms_eps) * (zs * _sigmoid(zs))).reshape(T, Hv * dv)
        return b.mm(out, self.ssm_out)


class Qwen35(Family):
    name, rope, norm_topk = "qwen35", "neox", True
    notes = ("gated delta-net layers (conv1d and recurrent state per sequence, chunked prefill) "
             "interleaved with gated full attention (q|gate projection, q/k norms, partial rope)")

    def hparams(self, key) -> dict:
        width = dict(kind=int, lo=1, hi=MAX_WIDTH)
        return {"full_attention_interval": key("full_attention_interval", 4, required=False, kind=int, lo=1,
                                               hi=MAX_LAYERS),
                "ssm_conv": key("ssm.conv_kernel", **width), "ssm_inner": key("ssm.inner_size", **width),
                "ssm_state": key("ssm.state_size", **width), "ssm_v_heads": key("ssm.time_step_rank", **width),
                "ssm_k_heads": key("ssm.group_count", **width)}

    def check(self, c, key) -> None:
        super().check(c, key)
        if c.get("ssm_inner") % c.get("ssm_v_heads"):
            key.fail("ssm.inner_size", c.get("ssm_inner"), f"must divide into ssm.time_step_rank, "
                     f"{c.get('ssm_v_heads')} value heads")

    def field_shapes(self, c, i, stored):
        E, out = c.n_embd, super().field_shapes(c, i, stored)
        if not self.recurrent(c, i):
            return out | {"wq": (2 * c.n_head * c.head_dim, E)}              # per head: query rows, then gate rows
        Hk, Hv, dk, inner = (c.get(k) for k in ("ssm_k_heads", "ssm_v_heads", "ssm_state", "ssm_inner"))
        channels = 2 * Hk * dk + inner                                        # q | k | v into the conv
        return out | {"wqkv": (channels, E), "wgate": (inner, E), "ssm_beta": (Hv, E), "ssm_alpha": (Hv, E),
                      "ssm_out": (E, inner), "ssm_conv": (channels, c.get("ssm_conv")), "ssm_dt": (Hv,),
                      "ssm_a": (Hv,), "ssm_norm": (inner // Hv,)}

    def recurrent(self, c, i: int) -> bool:
        return (i + 1) % c.get("full_attention_interval") != 0

    def matrices(self, c, i):
        p = f"blk.{i}."
        if self.recurrent(c, i):
            mats = {"wqkv": "attn_qkv", "wgate": "attn_gate", "ssm_beta": "ssm_beta", "ssm_alpha": "ssm_alpha",
                    "ssm_out": "ssm_out"}
        else:
            mats = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output"}
        ffn = super().matrices(c, i)
        return {k: p + v + ".weight" for k, v in mats.items()} | {k: v for k, v in ffn.items()
                                                                 if k not in ("wq", "wk", "wv", "wo")}

    def vectors(self, c, i):
        p = f"blk.{i}."
        v = {"attn_norm": p + "attn_norm.weight", "ffn_norm": p + "post_attention_norm.weight"}   # the pre-FFN norm
        if self.recurrent(c, i):
            v |= {"ssm_conv": p + "ssm_conv1d.weight", "ssm_dt": p + "ssm_dt.bias", "ssm_a": p + "ssm_a",
                  "ssm_norm": p + "ssm_norm.weight"}
        else:
            v |= {"q_norm": p + "attn_q_norm.weight", "k_norm": p + "attn_k_norm.weight"}
        if c.is_moe and self.shared_expert:
            v["shared_gate"] = p + "ffn_gate_inp_shexp.weight"
        return v

    def recurrent_state(self, c) -> dict[int, dict[str, tuple]]:
        """Shapes of the per-sequence state of each recurrent layer."""
        channels = 2 * c.get("ssm_k_heads") * c.get("ssm_state") + c.get("ssm_inner")
        dv = c.get("ssm_inner") // c.get("ssm_v_heads")
        return {i: {"conv": (c.get("ssm_conv") - 1, channels), "ssm": (c.get("ssm_v_heads"), c.get("ssm_state"), dv)}
                for i in range(c.n_layer) if self.recurrent(c, i)}

    def facts(self, c) -> dict:
        shapes = self.recurrent_state(c)
        per_seq = sum(4 * int(np.prod(s)) for st in shapes.values() for s in st.values())
        return {"recurrent_layers": len(shapes), "attention_layers": c.n_layer - len(shapes),
                "recurrent_state_bytes": per_seq, "ssm": {k: c.get(k) for k in ("ssm_conv", "ssm_inner", "ssm_state",
                                                                               "ssm_v_heads", "ssm_k_heads")}}

    def layer_weights(self, c, i, t):
        """The llama skeleton with a delta net or gated attention as its token mixer."""
        mixer = take(DeltaNet, t) if self.recurrent(c, i) else take(GatedAttention, t)
        return Layer(attn_norm=t["attn_norm"], attn=mixer, ffn_norm=t["ffn_norm"], ffn=self.ffn_weights(c, i, t))


class Qwen35Moe(Qwen35):
    name, moe, shared_expert = "qwen35moe", True, True
    notes = Qwen35.notes + "; routed experts (softmax, top-k renormalised) plus a sigmoid-gated shared expert"


def gated_delta_rule(q, k, v, g, beta, S) -> np.ndarray:
    """o_t = q_t·S_t with S_t = e^{g_t} S_{t-1} + k_t ⊗ β_t (v_t − k_t·e^{g_t} S_{t-1}), per head.

    q, k (T, H, dk); v (T, H, dv); g, beta (T, H); S (H, dk, dv) updated in place. One token:
    the recurrence; more: chunks of CHUNK positions, each solved at once (no per-token loop)."""
    T = q.shape[0]
    if T == 1:
        S *= np.exp(g[0])[:, None, None]
        kv = np.einsum("hk,hkv->hv", k[0], S)
        delta = (v[0] - kv) * beta[0][:, None]
        S += k[0][:, :, None] * delta[:, None, :]
        return np.einsum("hk,hkv->hv", q[0], S)[None].astype(F32)
    out = np.empty(v.shape, F32)
    qh, kh, vh = (np.ascontiguousarray(a.transpose(1, 0, 2)) for a in (q, k, v))     # (H, T, d)
    gh, bh = np.ascontiguousarray(g.T), np.ascontiguousarray(beta.T)                 # (H, T)
    for s in range(0, T, CHUNK):
        e = min(T, s + CHUNK)
        qc, kc, vc, gc, bc = qh[:, s:e], kh[:, s:e], vh[:, s:e], gh[:, s:e], bh[:, s:e]
        C = e - s
        gcum = np.cumsum(gc, axis=1, dtype=F32)                                       # (H, C)
        diff = gcum[:, :, None] - gcum[:, None, :]                                    # g_i - g_j
        lower = np.tril(np.ones((C, C), bool))
        decay = np.where(lower, np.exp(np.where(lower, diff, 0)), 0).astype(F32)      # (H, C, C)
        kb = kc * bc[:, :, None]
        A = -(kb @ kc.transpose(0, 2, 1)) * decay * (~np.eye(C, dtype=bool))          # strictly lower
        # (I - A) W = I  ↔  the forward substitution of the chunked delta rule
        W = _solve(np.eye(C, dtype=F32) - A, np.broadcast_to(np.eye(C, dtype=F32), A.shape))
        u = W @ (vc * bc[:, :, None])                                                 # (H, C, dv)
        w = W @ (kb * np.exp(gcum)[:, :, None])                                       # (H, C, dk)
        v_new = u - w @ S                                                             # (H, C, dv)
        attn = (qc @ kc.transpose(0, 2, 1)) * decay                                   # (H, C, C), lower incl. diag
        o = (qc * np.exp(gcum)[:, :, None]) @ S + attn @ v_new
        out[s:e] = o.transpose(1, 0, 2)
        last = gcum[:, -1]
        S *= np.exp(last)[:, None, None]
        S += (kc * np.exp(last[:, None] - gcum)[:, :, None]).transpose(0, 2, 1) @ v_new
    return out


def _solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a⁻¹b for a unit lower-triangular `a`, never singular unless its entries are not finite
    (weights of a corrupt file): then NaN, as the arithmetic would give, not an exception."""
    try:
        return np.linalg.solve(a, b).astype(F32)
    except np.linalg.LinAlgError:
        return np.full(b.shape, np.nan, F32)
