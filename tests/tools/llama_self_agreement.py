"""How far llama.cpp is from its own reference when only its arithmetic changes.

Runs a model's reference prompts through llama-cpp-python under settings that are the same
mathematics computed differently (flash attention on/off, f32 instead of f16 KV cache, one
thread, smaller batches) and measures each against the reference by the engine issue's
numbers: mean top-20 overlap and last-position logit correlation, per prompt.

    python tests/tools/llama_self_agreement.py MODEL.gguf tests/data/smollm2-moe-e8k2

On the E8K2 variant, flash attention alone takes prompt 3 to overlap 2.97/20 and correlation
0.66 (Kiln: 3.3 and 0.69): its routing turns on router-probability gaps of ~1e-4, so any
change of rounding re-routes tokens. Needs llama-cpp-python (0.3.36 made the references).
"""

import json
import sys

import numpy as np
from llama_cpp import Llama

SETTINGS = [dict(), dict(flash_attn=False), dict(n_threads=1), dict(n_batch=64),
            dict(flash_attn=True), dict(flash_attn=True, type_k=0, type_v=0)]


def main(model: str, ref_prefix: str) -> None:
    ref = json.load(open(ref_prefix + ".json"))
    npz = np.load(ref_prefix + ".npz")
    for kw in SETTINGS:
        args = dict(n_ctx=2048, n_threads=ref.get("n_threads", 2), logits_all=True, verbose=False) | kw
        llm = Llama(model, **args)
        row = {"settings": kw, "prompts": []}
        for i, p in enumerate(ref["prompts"]):
            llm.reset()
            llm.eval(p["ids"])
            logits = np.array(llm.scores[:len(p["ids"])])
            overlap = np.mean([len(set(np.argsort(-r)[:20].tolist()) & set(pos["top_ids"]))
                               for r, pos in zip(logits, p["positions"])])
            corr = float(np.corrcoef(logits[-1], npz[f"prompt{i}"])[0, 1])
            row["prompts"].append({"mean_top20_overlap": round(float(overlap), 2), "last_corr": round(corr, 4)})
        print(json.dumps(row), flush=True)
        del llm


if __name__ == "__main__":
    main(*sys.argv[1:3])
