"""A llama.cpp reference for any GGUF, in ../shared/reference's layout (prompts with top-20 per
position, margins, 32 greedy tokens; the last position's logits in the .npz), so that
tests/fidelity.py can hold Kiln to it — e.g. for a model re-quantized to K-quants:

    python tests/tools/make_reference.py MODEL.gguf tests/data/prompts.json OUT_PREFIX [N_BATCH [N_CTX [KV]]]

Same settings as the shared references: 2 threads, n_ctx 2048, default graph. N_BATCH (default
512) below 8 keeps llama.cpp off its tiled K-quant matmul, which it takes for batches of >= 8
rows (its vec_dot, which Kiln computes, for fewer) — llama.cpp's own batch dependence. Needs
llama-cpp-python (0.3.36 made the shared references); session tool, not a test dependency.
KV (e.g. q8_0 or q8_0/q4_0): the keys'/values' cache types (`-ctk`/`-ctv`), with flash attention
on, which llama.cpp needs for a quantized V cache (default: f16, its default graph).
"""

import json
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama


GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def main(model: str, prompts_path: str, out: str, n_batch: str = "512", n_ctx: str = "2048",
         kv: str = "f16", n_greedy: int = 32) -> None:
    spec = json.load(open(prompts_path))
    k, v = (kv.split("/") + kv.split("/"))[:2]
    extra = {} if kv == "f16" else {"type_k": GGML_TYPES[k], "type_v": GGML_TYPES[v], "flash_attn": True}
    llm = Llama(model, n_ctx=int(n_ctx), n_threads=2, logits_all=True, verbose=False,
                n_batch=int(n_batch), n_ubatch=int(n_batch), **extra)
    add_bos = bool(llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")
    ref, arrays = {"model": model, "n_threads": 2, "n_ctx": int(n_ctx), "kv": kv, "prompts": []}, {}
    for i, text in enumerate(spec["prompts"]):
        text = text["text"] if isinstance(text, dict) else text
        ids = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[:len(ids)], dtype=np.float32)
        positions = []
        for row in logits:
            top = np.argsort(-row, kind="stable")[:20]
            positions.append({"top_ids": top.tolist(), "top_logits": row[top].tolist(),
                              "margin": float(row[top[0]] - row[top[1]])})
        arrays[f"prompt{i}"] = logits[-1]
        greedy, margins, last = [], [], logits[-1]
        for _ in range(n_greedy):
            top2 = np.argsort(-last, kind="stable")[:2]
            greedy.append(int(top2[0]))
            margins.append(float(last[top2[0]] - last[top2[1]]))
            llm.eval([int(top2[0])])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        ref["prompts"].append({"text": text, "ids": list(ids), "positions": positions,
                               "greedy_ids": greedy, "greedy_margins": margins})
    json.dump(ref, open(out + ".json", "w"))
    np.savez(out + ".npz", **arrays)


TOKENIZE_TEXTS = ("Hello there, the cat sat on the mat.", "<|im_start|>user\nhi<|im_end|>\n", "the the the")


def tiny_reference(model: Path, prompts_path: Path, n_greedy: int = 24) -> None:
    """A tiny model's reference beside it (MODEL.json/.npz): main()'s, plus the model's name, the
    llama-cpp-python version and the tokens of TOKENIZE_TEXTS with and without special tokens."""
    import llama_cpp
    prefix = model.with_suffix("")
    main(str(model), str(prompts_path), str(prefix), n_greedy=n_greedy)
    ref = json.loads(prefix.with_suffix(".json").read_text())
    llm = llama_cpp.Llama(str(model), n_ctx=256, verbose=False, vocab_only=True)
    ref["model"], ref["llama_cpp_python"] = model.name, llama_cpp.__version__
    ref["tokenize"] = [{"text": t, "ids_no_special": llm.tokenize(t.encode(), add_bos=False, special=False),
                        "ids_special": llm.tokenize(t.encode(), add_bos=False, special=True)} for t in TOKENIZE_TEXTS]
    prefix.with_suffix(".json").write_text(json.dumps(ref))


if __name__ == "__main__":
    main(*sys.argv[1:7])
