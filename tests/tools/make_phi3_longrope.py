"""tiny-phi3-longrope.gguf: tiny-phi3 with Phi-3 128k's "longrope" tensors — per-pair rope factors
`rope_factors_long` / `rope_factors_short` and `rope.scaling.attn_factor` over an original context
of 1024 — and llama.cpp references at a context above it (long factors) and below it (short):

    python tests/tools/make_phi3_longrope.py            # writes tests/data/tiny/tiny-phi3-longrope*

Session tool (needs llama-cpp-python); the references are made by tests/tools/make_reference.py.
"""

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

TINY = Path(__file__).resolve().parents[1] / "data" / "tiny"
ORIGINAL_CTX = 1024
ATTN_FACTOR = 1.1902380714238083        # sqrt(1 + ln(32) / ln(4096)), as convert_hf_to_gguf computes it


def main() -> None:
    src = gguf.GGUFReader(str(TINY / "tiny-phi3.gguf"))
    out = TINY / "tiny-phi3-longrope.gguf"
    w = gguf.GGUFWriter(str(out), "phi3")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, field.contents(), vtype, sub_type=field.types[-1])
        else:
            w.add_key_value(key, field.contents(), vtype)
    w.add_uint32("phi3.rope.scaling.original_context_length", ORIGINAL_CTX)
    w.add_float32("phi3.rope.scaling.attn_factor", ATTN_FACTOR)
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    half = 16                                           # rope dim 32 / 2
    i = np.arange(half, dtype=np.float32)
    w.add_tensor("rope_factors_long.weight", (1.0 + 0.35 * i ** 1.5).astype(np.float32))
    w.add_tensor("rope_factors_short.weight", (1.0 + 0.04 * i).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for n_ctx, tag in ((2048, "long"), (512, "short")):
        subprocess.run([sys.executable, str(Path(__file__).parent / "make_reference.py"), str(out),
                        str(TINY.parent / "prompts_tiny.json"), str(TINY / f"tiny-phi3-longrope-{tag}"),
                        "512", str(n_ctx)], check=True)
    print(out, out.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
