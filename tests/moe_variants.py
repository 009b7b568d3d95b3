"""Build the "MoEfied" SmolLM2 variants of ../shared/reference/README.md, byte-exactly.

Each dense FFN of 1536 neurons becomes 8 experts of 192: expert e owns neurons [192e, 192e+192).
`ffn_gate_exps[e]`/`ffn_up_exps[e]` are Q4_1 rows 192e… of the dense gate/up (bytes copied);
`ffn_down_exps[e]` is, for each of the 576 rows of the dense down, its Q4_1 blocks 6e…6e+5.
E8K8: zero router, every down-expert block's d and m ×8, so uniform routing (1/8 each) gives
back the dense FFN. E8K2: the router of moe_router_E8.npy.

    python tests/moe_variants.py SMOLLM2.gguf OUT.gguf {2|8} [ROUTER.npy]
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kiln.native.gguf_file import read_gguf

HASHES = {
    "dense": "ca1e731921fc805791eb184188acef5ba1d09995b0f7395d1748015a37128ce7",
    2: "e66531fc3472b6c8cb6e60657c3f52bd7fdb2fa6c0c40ae11fec2e8e413fa869",
    8: "33b80eccfaadbe5319060e90e2b86c1a0db15bf56caba3af68e408385d2b7579",
}
E, FF, EMBD = 8, 1536, 576
FF_E = FF // E                       # 192 neurons per expert
Q41_BLOCK = 20                       # bytes per Q4_1 block of 32 weights: d f16, m f16, 16 B nibbles


def tensor_data_hash(path: Path) -> str:
    """sha256 over each tensor's name (UTF-8) followed by its raw bytes, in file order."""
    g = read_gguf(path)
    h = hashlib.sha256()
    for name in g.tensors:
        h.update(name.encode())
        h.update(g.raw(name).tobytes())
    return h.hexdigest()


def _experts_from_rows(rows: np.ndarray) -> np.ndarray:
    """(1536, 360) Q4_1 row bytes -> (8, 192, 360)."""
    return np.ascontiguousarray(rows.reshape(E, FF_E, -1))


def _experts_from_down(down: np.ndarray, scale: float) -> np.ndarray:
    """(576, 48 blocks × 20 B) Q4_1 bytes -> (8, 576, 6 blocks × 20 B), d and m scaled."""
    blocks = down.reshape(EMBD, E, FF_E // 32, Q41_BLOCK).transpose(1, 0, 2, 3).copy()
    if scale != 1.0:
        dm = blocks[..., :4].copy().view(np.float16)          # d and m, fp16 each
        blocks[..., :4] = (dm * np.float16(scale)).view(np.uint8)
    return blocks.reshape(E, EMBD, (FF_E // 32) * Q41_BLOCK)


def build_variant(src: Path, out: Path, k: int, router: np.ndarray | None = None) -> Path:
    if k not in (2, 8):
        raise ValueError("k must be 2 (E8K2) or 8 (E8K8)")
    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = GGUFWriter(out, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        val, vtype = field.contents(), field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        if key == f"{arch}.feed_forward_length":
            val = FF_E
        elif key == "general.name":
            val = f"{val} MoEfied E8K{k}"
        w.add_key_value(key, val, vtype, sub)
        if key == f"{arch}.feed_forward_length":
            w.add_key_value(f"{arch}.expert_count", E, GGUFValueType.UINT32)
            w.add_key_value(f"{arch}.expert_used_count", k, GGUFValueType.UINT32)
    if k == 2 and router is None:
        raise ValueError("E8K2 needs the router weights (moe_router_E8.npy)")
    for t in r.tensors:
        name, data = t.name, np.asarray(t.data)
        parts = name.split(".")
        if len(parts) == 4 and parts[2] in ("ffn_gate", "ffn_up", "ffn_down"):
            assert t.tensor_type == Q.Q4_1, name
            exps = (_experts_from_down(data, 8.0 if k == 8 else 1.0) if parts[2] == "ffn_down"
                    else _experts_from_rows(data))
            w.add_tensor(f"blk.{parts[1]}.{parts[2]}_exps.weight", exps, raw_dtype=Q.Q4_1)
            continue
        if len(parts) == 4 and parts[2] == "ffn_norm":
            layer = int(parts[1])
            gate = np.zeros((E, EMBD), np.float32) if k == 8 else router[layer].astype(np.float32)
            w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", gate)
        w.add_tensor(name, data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


if __name__ == "__main__":
    src, out, k = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    router = np.load(sys.argv[4]) if len(sys.argv) > 4 else None
    build_variant(src, out, k, router)
    digest = tensor_data_hash(out)
    print(out, digest, "OK" if digest == HASHES[k] else "MISMATCH")
