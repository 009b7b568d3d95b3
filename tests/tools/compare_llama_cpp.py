"""Kiln against the llama.cpp installed here, on the same file and prompt token ids: per prompt,
how many positions have equal top-20 logits, and the largest difference over the whole vocabulary.

    python tests/tools/compare_llama_cpp.py tests/data/tiny/tiny-gemma3.gguf tests/data/tiny/tiny-gemma3.json

The second argument is a reference JSON (its prompts' ids are used). Needs llama-cpp-python
(session tool, not a test dependency; tests/data/README.md says how it was built here)."""

import json
import sys

import numpy as np
from llama_cpp import Llama

from kiln.native.model import load_model


def main(model: str, ref_json: str, n_batch: str = "512") -> None:
    ref = json.load(open(ref_json))
    llm = Llama(model, n_ctx=2048, n_threads=2, logits_all=True, verbose=False, n_batch=int(n_batch),
                n_ubatch=int(n_batch))
    m = load_model(model)
    for i, p in enumerate(ref["prompts"]):
        ids = p["ids"]
        llm.reset()
        llm.eval(ids)
        theirs = np.array(llm.scores[:len(ids)], dtype=np.float32)
        ours = m.forward(ids, m.new_cache(len(ids) + 1), all_logits=True)
        tops = [np.argsort(-row, kind="stable")[:20] for row in theirs]
        equal = sum(np.array_equal(ours[j][t], theirs[j][t]) for j, t in enumerate(tops))
        print(json.dumps({"prompt": i, "positions": len(ids), "top20_equal": int(equal),
                          "max_abs_diff": float(np.abs(ours - theirs).max())}))


if __name__ == "__main__":
    main(*sys.argv[1:4])
