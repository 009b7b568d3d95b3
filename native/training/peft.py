"""Hugging Face PEFT LoRA adapters in and out: `adapter_config.json` + `adapter_model.safetensors`
(read and written with the `safetensors` package) <-> the GGUF LoRA llama.cpp loads.

What the conversion must get right (llama.cpp's convert_lora_to_gguf does the same):
- names: `base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` -> `blk.N.attn_q.weight`
  `.lora_a` (and k/v/o, mlp gate/up/down);
- orientation: PEFT's lora_A (r, in) and lora_B (out, r) are already the GGUF tensors' numpy
  shapes (ggml stores them as ne = [in, r] and [r, out]): no transpose;
- the rotary permutation: for llama-family files the GGUF converter reorders the rows of the
  q and k projections, (head, 2, d/2) -> (head, d/2, 2), so a LoRA's B of q_proj / k_proj
  gets the same row permutation (A is untouched: dW = B A permutes with B's rows);
- scale: GGUF keeps alpha and llama.cpp uses alpha / r; PEFT's rsLoRA (alpha / sqrt(r)) is
  carried by storing alpha * sqrt(r).
Anything PEFT can express that a GGUF LoRA cannot (DoRA, per-module ranks or alphas, trained
biases, extra saved modules, Conv1D fan-in-fan-out) is refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from ..lora import TARGETS, Adapter, AdapterError

PEFT_MODULE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
GGUF_TARGET = {v.split(".")[1]: k for k, v in PEFT_MODULE.items()}
PERMUTED_ARCHS = ("llama", "mistral")          # the converter permutes q/k rows for these
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)"
                  r"\.lora_([AB])(?:\.default)?\.weight$")


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF -> GGUF row order of a q/k projection (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _heads(target: str, n_head: int, n_head_kv: int) -> int | None:
    return n_head if target == "attn_q" else n_head_kv if target == "attn_k" else None


def _config(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path.parent}: no adapter_config.json (a PEFT adapter folder has "
                           f"adapter_config.json and adapter_model.safetensors)") from None
    except ValueError as e:
        raise AdapterError(f"{path}: not valid JSON ({e})") from None
    if str(cfg.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    refused = [(k, why) for k, why in (
        ("use_dora", "DoRA's magnitude vectors"), ("fan_in_fan_out", "Conv1D (fan_in_fan_out) weights"),
        ("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas"),
        ("modules_to_save", "fully trained extra modules"), ("layers_to_transform", "a subset of layers by index"))
        if cfg.get(k)]
    if cfg.get("bias", "none") != "none":
        refused.append(("bias", "trained biases"))
    if refused:
        k, why = refused[0]
        raise AdapterError(f"{path}: {k} = {cfg[k]!r} — a GGUF LoRA cannot hold {why}")
    return cfg


def import_peft(folder: str | os.PathLike, arch: str, n_head: int, n_head_kv: int) -> Adapter:
    """A PEFT LoRA folder as an Adapter for a base model of `arch` with these head counts."""
    try:
        from safetensors.numpy import load_file
    except ImportError:  # pragma: no cover - a dependency
        raise AdapterError("importing a PEFT adapter needs the safetensors package: pip install safetensors") from None
    folder = Path(folder)
    cfg = _config(folder / "adapter_config.json")
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise AdapterError(f"{folder}: no adapter_model.safetensors (only the safetensors form is read; "
                           f"convert an adapter_model.bin with PEFT first)")
    try:
        raw = load_file(str(weights))
    except Exception as e:  # noqa: BLE001 - a damaged file: the reader's words
        raise AdapterError(f"{weights}: cannot be read: {e}") from None
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, t in raw.items():
        m = _KEY.match(key)
        if not m or m.group(2) not in GGUF_TARGET:
            raise AdapterError(f"{weights}: tensor {key!r} is not a LoRA factor of a projection Kiln "
                               f"adapts ({', '.join(PEFT_MODULE.values())})")
        target = GGUF_TARGET[m.group(2)]
        pairs.setdefault(f"blk.{m.group(1)}.{target}.weight", {})[m.group(3)] = np.asarray(t, np.float32)
    if not pairs:
        raise AdapterError(f"{weights}: holds no LoRA tensors")
    tensors = {}
    ranks = set()
    # layer by layer, in the order Kiln and llama.cpp write a LoRA's tensors
    for name, p in sorted(pairs.items(), key=lambda kv: (int(kv[0].split(".")[1]), TARGETS.index(kv[0].split(".")[2]))):
        if set(p) != {"A", "B"}:
            raise AdapterError(f"{weights}: {name} has lora_{''.join(sorted(p))} but needs both A and B")
        a, b = p["A"], p["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise AdapterError(f"{weights}: {name}: lora_A {a.shape} and lora_B {b.shape} do not multiply")
        heads = _heads(name.split(".")[2], n_head, n_head_kv) if arch in PERMUTED_ARCHS else None
        if heads:
            b = permute_rows(b, heads)
        tensors[name] = (np.ascontiguousarray(a), np.ascontiguousarray(b))
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise AdapterError(f"{weights}: the factors have ranks {sorted(ranks)}; a GGUF LoRA has one")
    r = ranks.pop()
    if cfg.get("r") not in (None, r):
        raise AdapterError(f"{folder}: adapter_config.json says r = {cfg['r']} but the tensors have rank {r}")
    alpha = float(cfg.get("lora_alpha") or r)
    if cfg.get("use_rslora"):
        alpha *= math.sqrt(r)                   # scale alpha / sqrt(r) == (alpha sqrt(r)) / r
    return Adapter(arch, alpha, tensors, {"kiln.source": f"peft:{folder.name}"})


def export_peft(adapter: Adapter, folder: str | os.PathLike, n_head: int, n_head_kv: int,
                base_model: str = "") -> Path:
    """Write `adapter` as a PEFT LoRA folder (the inverse of import_peft)."""
    from safetensors.numpy import save_file
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out, modules = {}, set()
    for name, (a, b) in adapter.tensors.items():
        _, layer, target, _ = name.split(".")
        heads = _heads(target, n_head, n_head_kv) if adapter.arch in PERMUTED_ARCHS else None
        if heads:
            b = unpermute_rows(b, heads)
        key = f"base_model.model.model.layers.{layer}.{PEFT_MODULE[target]}"
        out[key + ".lora_A.weight"] = np.ascontiguousarray(a, np.float32)
        out[key + ".lora_B.weight"] = np.ascontiguousarray(b, np.float32)
        modules.add(PEFT_MODULE[target].split(".")[1])
    save_file(out, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
           "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": 0.0, "bias": "none",
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "inference_mode": True,
           "target_modules": sorted(modules, key=lambda m: TARGETS.index(GGUF_TARGET[m]))}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return folder
