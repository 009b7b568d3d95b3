"""tests/data/tiny/tiny-ernie4_5.gguf and its llama.cpp reference: tiny-llama's weights and
vocabulary under ERNIE 4.5's architecture name (`ernie4_5.*` keys) — llama.cpp runs ERNIE 4.5
dense through its own graph (src/models/ernie4-5.cpp), the llama skeleton, so the reference is
what that graph computes.

    python tests/tools/make_tiny_ernie.py
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"


def main() -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    from gguf_copy import copy_gguf
    out = copy_gguf(TINY / "tiny-llama.gguf", TINY / "tiny-ernie4_5.gguf", "ernie4_5",
                    rename=lambda k: "ernie4_5." + k[len("llama."):] if k.startswith("llama.") else k,
                    meta={"general.name": "tiny-ernie4_5"})
    make_reference.tiny_reference(out, HERE / "data" / "prompts_tiny.json")


if __name__ == "__main__":
    main()
