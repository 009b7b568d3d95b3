"""The parts a family's layer is made of — attention, a dense FFN, routed experts — each its
weights (a small dataclass filled at load from the tensors the family names) and its forward,
written in the operations of a batch (native/batch.py: norm, project, attend).

A family composes these into its layer and adds what only it has as its own subclass, in its
own module: q/k/v biases (qwen2), q/k norms (qwen3, olmoe), sinks (gpt-oss), a gated query and
delta nets (qwen35), norms of the blocks' outputs (gemma3). `Layer` is the llama skeleton:

    x = x + attention(norm(x))
    x = x + ffn(norm(x))

Settings a family decides per layer at load (a sliding window, another rope base) are fields
of the part, not tests in the forward. How a layer runs — one compiled call, streamed experts,
these blocks — is chosen in native/runners.py, and is invisible here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
from gguf import GGMLQuantizationType as Q

from ..blocks import apply_rope, rms_norm, route, swiglu_ffn
from ..kernels import Weight, matmul, sigmoid

F32 = np.float32


def take(cls, t: dict, **settings):
    """A part of class `cls` from a layer's loaded tensors (field -> tensor): the fields it
    declares, and the load-time `settings`."""
    names = {f.name for f in fields(cls) if f.init} - set(settings)
    return cls(**{k: v for k, v in t.items() if k in names}, **settings)


def vector_weight(name: str, v: np.ndarray) -> Weight:
    """A stored vector as a (1, n) float32 matrix the kernels multiply (a shared expert's gate)."""
    v = v.reshape(1, -1)
    return Weight(name, Q.F32, v.shape, v.view(np.uint8).reshape(1, -1), v)


def arrays(part):
    """Every weight and vector a part (a layer, or one of its parts) holds, depth first."""
    for f in fields(part):
        v = getattr(part, f.name)
        if isinstance(v, (Weight, np.ndarray)):
            yield v
        elif hasattr(v, "__dataclass_fields__"):
            yield from arrays(v)


# -- attention -------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Attention:
    """Multi-head self-attention with grouped KV heads: q, k, v → rope → attend over the cache →
    output. `window` > 0: a sliding-window layer; `rope_base`: its own rope base."""
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight
    window: int = 0
    rope_base: float | None = None

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        c = b.config
        q, k, v = self.heads(c, *b.project_many(x, (self.wq, self.wk, self.wv)))
        cos, sin = b.rope(self.rope_base)
        q = apply_rope(np.ascontiguousarray(q), cos, sin, c.rope_style)
        k = apply_rope(np.ascontiguousarray(k), cos, sin, c.rope_style)
        q_scale, kq_scale = b.attn_scales
        if q_scale:
            q *= F32(q_scale)
        return b.project(b.attend(i, q, k, v, kq_scale or None, self.window), self.wo)

    def heads(self, c, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        """The projections (T, H*d) as heads (T, H, d): where a family's attention adds its touches."""
        T = q.shape[0]
        return (q.reshape(T, c.n_head, c.head_dim), k.reshape(T, c.n_head_kv, c.head_dim),
                v.reshape(T, c.n_head_kv, c.head_dim))


@dataclass(kw_only=True)
class BiasedAttention(Attention):
    """q, k and v with biases (qwen2)."""
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray

    def heads(self, c, q, k, v):
        return super().heads(c, q + self.bq, k + self.bk, v + self.bv)


@dataclass(kw_only=True)
class NormedAttention(Attention):
    """q and k RMS-normed per head before rope (qwen3, gemma3)."""
    q_norm: np.ndarray
    k_norm: np.ndarray

    def heads(self, c, q, k, v):
        q, k, v = super().heads(c, q, k, v)
        return rms_norm(q, self.q_norm, c.rms_eps), rms_norm(k, self.k_norm, c.rms_eps), v


# -- feed-forward ----------------------------------------------------------------------------

@dataclass(kw_only=True)
class FFN:
    """SwiGLU: down(silu(gate x) · up x)."""
    gate: Weight
    up: Weight
    down: Weight

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        return swiglu_ffn(x, self.gate, self.up, self.down, b.mm)


@dataclass(kw_only=True)
class MoE:
    """Routed experts: softmax over the router's logits, the top k (renormalised when the model
    says so), each chosen expert a SwiGLU, their outputs summed by weight. The experts' bytes
    come from the batch's source: the mapped file, or an expert cache (native/experts/)."""
    router: Weight                 # (n_expert, n_embd)
    gate_exps: Weight              # (n_expert, n_ff_expert, n_embd)
    up_exps: Weight
    down_exps: Weight
    _views: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def expert(self, e: int) -> tuple[Weight, Weight, Weight]:
        """Expert e's (gate, up, down), views of the stacks made once."""
        w = self._views.get(e)
        if w is None:
            w = self._views[e] = (self.gate_exps.expert(e), self.up_exps.expert(e), self.down_exps.expert(e))
        return w

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        c = b.config
        experts, weights = route(x, self.router, c.n_expert_used, c.expert_weights_norm)
        residual, b.residual = b.residual, None
        return b.experts.ffn(i, self, x, experts, weights, residual)


@dataclass(kw_only=True)
class SharedExpertMoE(MoE):
    """Routed experts plus a shared expert every row takes, gated by sigmoid(shared_gate · x)
    (qwen2moe, qwen35moe)."""
    gate_shexp: Weight
    up_shexp: Weight
    down_shexp: Weight
    shared_gate: Weight            # (1, n_embd)

    def __call__(self, i, x, b):
        out = super().__call__(i, x, b)
        gate = sigmoid(matmul(x, self.shared_gate))          # (T, 1), as the one-call decode's (csrc/ffn_rows.c)
        out += gate * swiglu_ffn(x, self.gate_shexp, self.up_shexp, self.down_shexp)
        return out


# -- the layer -------------------------------------------------------------------------------

@dataclass(kw_only=True)
class Layer:
    """The llama skeleton: pre-norm attention and pre-norm FFN, each added to the residual
    stream. `attn` is any token mixer (qwen35's delta nets too), `ffn` dense or routed."""
    attn_norm: np.ndarray
    attn: Attention
    ffn_norm: np.ndarray
    ffn: FFN | MoE

    def __call__(self, i: int, x: np.ndarray, b) -> np.ndarray:
        x = x + self.attn(i, b.norm(x, self.attn_norm), b)
        b.residual = x
        return x + self.ffn(i, b.norm(x, self.ffn_norm), b)

    def expert(self, e: int) -> tuple[Weight, Weight, Weight]:
        return self.ffn.expert(e)
