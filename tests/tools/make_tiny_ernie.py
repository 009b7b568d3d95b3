"""tests/data/tiny/tiny-ernie4_5.gguf and its llama.cpp reference: tiny-llama's weights and
vocabulary under ERNIE 4.5's architecture name (`ernie4_5.*` keys) — llama.cpp runs ERNIE 4.5
dense through its own graph (src/models/ernie4-5.cpp), the llama skeleton, so the reference is
what that graph computes.

    python tests/tools/make_tiny_ernie.py
"""

import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"


def main() -> None:
    src = GGUFReader(TINY / "tiny-llama.gguf")
    out = TINY / "tiny-ernie4_5.gguf"
    w = GGUFWriter(str(out), "ernie4_5")
    for k, f in src.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        v = f.contents()
        name = "ernie4_5." + k[len("llama."):] if k.startswith("llama.") else k
        if k == "general.name":
            v = "tiny-ernie4_5"
        if k == "tokenizer.ggml.token_type":
            w.add_token_types(v)
        elif f.types[0].name == "ARRAY":
            w.add_array(name, v)
        else:
            w.add_key_value(name, v, f.types[0])
    for t in src.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    sys.path.insert(0, str(HERE / "tools"))
    import make_reference
    import json

    import llama_cpp
    prefix = TINY / "tiny-ernie4_5"
    make_reference.main(str(out), str(HERE / "data" / "prompts_tiny.json"), str(prefix), n_greedy=24)
    ref = json.loads(prefix.with_suffix(".json").read_text())
    llm = llama_cpp.Llama(str(out), n_ctx=256, verbose=False, vocab_only=True)
    ref["model"], ref["llama_cpp_python"] = out.name, llama_cpp.__version__
    ref["tokenize"] = [{"text": t, "ids_no_special": llm.tokenize(t.encode(), add_bos=False, special=False),
                        "ids_special": llm.tokenize(t.encode(), add_bos=False, special=True)}
                       for t in ("Hello there, the cat sat on the mat.", "<|im_start|>user\nhi<|im_end|>\n", "the the the")]
    prefix.with_suffix(".json").write_text(json.dumps(ref))


if __name__ == "__main__":
    main()
