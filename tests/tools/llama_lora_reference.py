"""Make tests/data/lora_llamacpp.json/.npz: llama.cpp's logits on the default model with a LoRA.

Run in an environment with llama-cpp-python 0.3.36 (built from source, -march=native), 2 threads:

    python tests/tools/llama_lora_reference.py MODEL.gguf ADAPTER.gguf tests/data/prompts.json OUT_PREFIX HASH

ADAPTER is the seeded adapter that tests/test_lora_interop.py builds (`interop_adapter`);
HASH is its tensor-data hash (`tensor_hash` there), recorded so the test knows it rebuilt the
same adapter. Layout as
../shared/reference (positions' top-20 ids/logits and margins, 32 greedy tokens with margins;
the .npz holds the last prompt position's full logits).
"""

import json
import sys

import numpy as np
from llama_cpp import Llama, __version__


def main(model, adapter, prompts_file, out, adapter_hash):
    prompts = json.load(open(prompts_file))
    llm = Llama(model, lora_path=adapter, n_ctx=2048, n_threads=2, logits_all=True, verbose=False)
    res = {"model": model.split("/")[-1], "adapter": adapter.split("/")[-1], "llama_cpp_python": __version__,
           "adapter_tensor_sha256": adapter_hash, "n_threads": 2, "prompts": []}
    last = {}
    for i, p in enumerate(prompts["prompts"]):
        ids = llm.tokenize(p["text"].encode(), add_bos=False, special=True) if isinstance(p, dict) else \
            llm.tokenize(p.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        scores = np.array(llm.scores[:len(ids)], np.float32)
        positions = []
        for row in scores:
            top = np.argsort(-row, kind="stable")[:20]
            positions.append({"top_ids": top.tolist(), "top_logits": row[top].tolist(),
                              "margin": float(row[top[0]] - row[top[1]])})
        last[f"prompt{i}"] = scores[-1]
        greedy, margins = [], []
        row = scores[-1]
        for _ in range(prompts.get("greedy_tokens", 32)):
            top = np.argsort(-row, kind="stable")[:2]
            greedy.append(int(top[0]))
            margins.append(float(row[top[0]] - row[top[1]]))
            llm.eval([int(top[0])])
            row = np.array(llm.scores[llm.n_tokens - 1], np.float32)
        res["prompts"].append({"ids": ids, "positions": positions, "greedy_ids": greedy, "greedy_margins": margins})
    json.dump(res, open(out + ".json", "w"))
    np.savez_compressed(out + ".npz", **last)
    print(out, "written")


if __name__ == "__main__":
    main(*sys.argv[1:6])
