"""LoRA adapters: what they hold, how they start, and the GGUF form llama.cpp loads.

An adapter adds `scale * B @ A` to a base weight W (n_out, n_in), scale = alpha / rank, with
A (rank, n_in) and B (n_out, rank) — so a layer computes y = x W^T + scale * (x A^T) B^T.
On disk it is a GGUF with `general.type = "adapter"`, `adapter.type = "lora"`,
`adapter.lora.alpha`, the base's `general.architecture`, and tensors `<base name>.lora_a` /
`.lora_b` in float32 (fp16 when the adapter holds fp16, as llama.cpp's `convert_lora_to_gguf`
writes it): exactly what llama.cpp's `llama_adapter_lora_init` reads.

In inference the two small products run through the same `matmul` as the base weights (F32
weights: no activation rounding, as ggml multiplies F32 LoRA tensors), in llama.cpp's order:
B (A x), then the scale, then the add.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter

from .gguf_file import GGUFError, read_gguf
from .kernels import Weight, matmul

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TRAINABLE_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


class AdapterError(ValueError):
    pass


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        if not 1 <= self.rank <= 1024:
            raise AdapterError(f"LoRA rank {self.rank} is out of range: use 1..1024")
        if not self.alpha > 0:
            raise AdapterError(f"LoRA alpha {self.alpha} must be positive")
        bad = [t for t in self.targets if t not in TARGETS]
        if bad or not self.targets:
            raise AdapterError(f"LoRA targets {list(bad) or '[]'} are not valid: choose among {', '.join(TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def base_names(n_layer: int, targets) -> list[str]:
    """The base weight names a LoRA over `targets` adapts, in layer order."""
    return [f"blk.{i}.{t}.weight" for i in range(n_layer) for t in TARGETS if t in targets]


@dataclass
class Adapter:
    """LoRA tensors by base weight name: (A (r, n_in), B (n_out, r)), float32 — or float16 as an
    fp16 file holds them (llama.cpp's convert_lora_to_gguf writes fp16 by default): half the bytes
    a decode step reads, and the same bits, since every product widens each value exactly."""
    arch: str
    alpha: float
    tensors: dict[str, tuple[np.ndarray, np.ndarray]]
    meta: dict = field(default_factory=dict)
    path: Path | None = None
    _weights: dict | None = None
    _pairs: dict = field(default_factory=dict)      # layer -> its compiled-step pairs (layer_pairs)
    _held: list = field(default_factory=list)
    compiled: dict = field(default_factory=dict)    # (layer, ffn) -> its row of the step's LoRA table (runners.py)
    _other: frozenset | None = None
    _asked: set | None = None                       # check_applied: the names the blocks asked for

    @property
    def rank(self) -> int:
        return next(iter(self.tensors.values()))[0].shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def targets(self) -> list[str]:
        """The projections it adapts: Kiln's seven in their order, then any other name a
        llama.cpp adapter gives (attn_qkv, ssm_out, output, ...), sorted."""
        names = {n.split(".")[2] if n.startswith("blk.") and n.count(".") >= 3 else n.removesuffix(".weight")
                 for n in self.tensors}
        return [t for t in TARGETS if t in names] + sorted(names - set(TARGETS))

    @property
    def other_layers(self) -> frozenset[int]:
        """The layers where it names a weight outside the seven the compiled decode step adds
        (csrc/layer.h LoraPair): those layers take their blocks, which adapt any weight."""
        if self._other is None:
            self._other = frozenset(int(n.split(".")[1]) for n in self.tensors if n.startswith("blk.")
                                    and n.count(".") >= 3 and n.split(".")[1].isdigit() and n.split(".")[2] not in TARGETS)
        return self._other

    def delta(self, x: np.ndarray, base: Weight) -> np.ndarray | None:
        """scale * B (A x) for the rows x, or None when this adapter leaves `base` alone."""
        if self._weights is None:        # fp16 pairs widen at each use: no float32 copy held beside them
            self._weights = {n: (_f32_weight(n + ".lora_a", a), _f32_weight(n + ".lora_b", b))
                             if a.dtype != np.float16 else None for n, (a, b) in self.tensors.items()}
        if self._asked is not None:
            self._asked.add(base.name)
        if base.name not in self._weights:
            return None
        ab = self._weights[base.name]
        if ab is None:
            a, b = self.tensors[base.name]
            ab = _f32_weight(base.name + ".lora_a", a), _f32_weight(base.name + ".lora_b", b)
        out = matmul(matmul(x, ab[0]), ab[1])
        out *= np.float32(self.scale)
        return out

    def scaled(self, s: float) -> "Adapter":
        """This adapter applied `s` times as strongly (llama.cpp's per-request LoRA scale: the
        effective scale s * alpha / rank), sharing its tensors."""
        from dataclasses import replace
        return replace(self, alpha=float(np.float32(s) * np.float32(self.alpha)), _weights=self._weights,
                       _pairs={}, _held=self._held, compiled={})

    def layer_pairs(self, i: int) -> list:
        """Layer i's (A address, B address, rank, scale) per projection in csrc/kiln.h's order
        (q, k, v, o, gate, up, down), None where the adapter leaves it alone: what the compiled
        decode step adds (float32 or fp16, as held). The arrays are held here, so the addresses
        stay valid."""
        cached = self._pairs.get(i)
        if cached is None:
            cached = []
            for t in TARGETS:
                ab = self.tensors.get(f"blk.{i}.{t}.weight")
                if ab is None:
                    cached.append(None)
                    continue
                dt = np.float16 if ab[0].dtype == np.float16 and ab[1].dtype == np.float16 else np.float32
                a, b = (np.ascontiguousarray(m, dt) for m in ab)
                self._held.append((a, b))
                cached.append((a.ctypes.data, b.ctypes.data, a.shape[0], np.float32(self.scale),
                               int(dt == np.float16), 0))
            self._pairs[i] = cached
        return cached

    def check_applied(self, model) -> None:
        """Refuse an adapter naming a weight the model multiplies without adapters (a router,
        routed experts, ...): it would load and change nothing there. Found by one token through
        the model — a layer with such a name takes its blocks (other_layers), which ask for
        each delta they add — and only for an adapter naming weights beyond the seven every
        family adapts, so the usual adapter costs nothing here."""
        if set(self.targets) <= set(TARGETS):
            return
        self._asked = set()
        try:
            model.forward([0], model.new_cache(8), adapter=self)
            never = sorted(n for n in set(self.tensors) - self._asked
                           if not (n.startswith("blk.") and n.count(".") >= 3 and n.split(".")[2] in TARGETS))
        finally:
            self._asked = None
        if never:
            raise AdapterError(f"adapter tensors {', '.join(never[:4])}{' ...' if len(never) > 4 else ''}: "
                               f"{model.gguf.path.name} multiplies {'these weights' if len(never) > 1 else 'this weight'} "
                               "without adapters (a router, routed experts, ...), so the adapter would change "
                               "nothing there; make it without them")

    def check_fits(self, g) -> None:
        """Refuse an adapter made for another architecture or other tensor shapes than the
        base model's GGUF `g`."""
        name = g.path.name
        if self.arch != g.architecture:
            raise AdapterError(f"the adapter is for architecture {self.arch!r}, {name} is {g.architecture!r}")
        for n, (a, b) in self.tensors.items():
            try:
                info = g.tensor(n)
            except GGUFError:
                raise AdapterError(f"adapter tensor {n}.lora_a names no tensor of {name}") from None
            n_out, n_in = info.shape
            if a.shape[1] != n_in or b.shape[0] != n_out or a.shape[0] != b.shape[1]:
                raise AdapterError(f"adapter tensor {n}: lora_a {a.shape} / lora_b {b.shape} do not "
                                   f"fit the base weight ({n_out}, {n_in}) of {name}")


def _f32_weight(name: str, m: np.ndarray) -> Weight:
    m = np.ascontiguousarray(m, np.float32)
    return Weight(name, Q.F32, m.shape, m.view(np.uint8).reshape(m.shape[0], -1), m)


def init_adapter(model, cfg: LoraConfig, rng: np.random.Generator) -> Adapter:
    """A at Kaiming-uniform (a = sqrt(5), as PEFT: U(-1/sqrt(n_in), 1/sqrt(n_in))), B at zero,
    so training starts from the base model exactly."""
    c = model.config
    if c.arch not in TRAINABLE_ARCHS or c.is_moe:
        raise AdapterError(f"LoRA training supports dense {', '.join(TRAINABLE_ARCHS)} models; "
                           f"{model.path.name} is {c.arch}{' (MoE)' if c.is_moe else ''}")
    tensors = {}
    for n in base_names(c.n_layer, cfg.targets):
        n_out, n_in = model.gguf.tensor(n).shape
        bound = 1.0 / np.sqrt(n_in)
        a = rng.uniform(-bound, bound, size=(cfg.rank, n_in)).astype(np.float32)
        tensors[n] = (a, np.zeros((n_out, cfg.rank), np.float32))
    return Adapter(c.arch, float(cfg.alpha), tensors)


def save_adapter(adapter: Adapter, path: str | os.PathLike, name: str = "") -> Path:
    """Write the adapter as a llama.cpp LoRA GGUF, atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), adapter.arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(adapter.alpha))
    if name:
        w.add_string("general.name", name)
    for key, value in adapter.meta.items():
        if isinstance(value, str) and key.startswith("kiln."):
            w.add_string(key, value)
    for n, (a, b) in adapter.tensors.items():        # fp16 pairs stay fp16, the rest float32
        dt = np.float16 if a.dtype == b.dtype == np.float16 else np.float32
        w.add_tensor(n + ".lora_a", np.ascontiguousarray(a, dt))
        w.add_tensor(n + ".lora_b", np.ascontiguousarray(b, dt))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_adapter(path: str | os.PathLike) -> Adapter:
    """Read a LoRA GGUF (ours or llama.cpp's convert_lora_to_gguf output). F16 pairs stay fp16;
    any other type (F32, BF16, Q8_0, ...) is widened to float32 exactly."""
    from gguf.quants import dequantize
    g = read_gguf(path)
    md = g.metadata
    if md.get("general.type") != "adapter" or md.get("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a LoRA adapter (general.type={md.get('general.type')!r}, "
                           f"adapter.type={md.get('adapter.type')!r})")
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for n, info in g.tensors.items():
        base, _, part = n.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise AdapterError(f"{path}: tensor {n!r} is neither .lora_a nor .lora_b")
        if info.type == Q.F16:
            m = g.raw(n).view(np.float16).reshape(info.shape).copy()
        else:
            m = np.ascontiguousarray(dequantize(g.raw(n), info.type).reshape(info.shape), np.float32)
        pairs.setdefault(base, {})[part] = m
    tensors = {}
    for base, p in pairs.items():
        if set(p) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{path}: {base} has {sorted(p)} but needs both lora_a and lora_b")
        a, b = p["lora_a"], p["lora_b"]
        if a.dtype != b.dtype:            # one fp16, one not: both float32, so a pair has one type
            a, b = a.astype(np.float32), b.astype(np.float32)
        tensors[base] = (a, b)
    if not tensors:
        raise AdapterError(f"{path}: the adapter holds no tensors")
    meta = {k: v for k, v in md.items() if k.startswith("kiln.") or k == "general.name"}
    rank = next(iter(tensors.values()))[0].shape[0]
    alpha = float(md.get("adapter.lora.alpha") or 0) or float(rank)   # llama.cpp: no alpha -> scale 1
    return Adapter(g.architecture, alpha, tensors, meta, Path(path))


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
