"""A llama.cpp reference for context shift: greedy decoding past the end of a small context,
shifted as llama-server shifts it (server-context.cpp pre_decode) through llama-cpp-python's
low-level sequence calls — llama_memory_seq_rm of the discarded positions, llama_memory_seq_add
of -n_discard to the later ones (llama.cpp re-ropes their keys at the next decode):

    python tests/tools/make_shift_reference.py MODEL.gguf OUT.json [N_CTX [N_GEN [KV [N_KEEP [PROMPT]]]]]

When the cache holds n_ctx - 1 tokens and the next one is to be decoded, n_keep (plus one with
a BOS, at most n_ctx - 4) stay and half of the rest go. Writes the prompt, every greedy id with
its margin (top-1 minus top-2 logit) and the step of each shift. 2 threads; KV (the keys'/values'
cache types) as make_reference.py takes it: f16 on llama.cpp's default graph (the shared
references'), a quantized cache with flash attention (which llama.cpp needs for a quantized V).
Session tool, not a test dependency (needs llama-cpp-python 0.3.36).
"""

import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama

PROMPT = "The history of the printing press begins in"
GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def main(model: str, out: str, n_ctx: str = "256", n_gen: str = "400", kv: str = "f16", n_keep: str = "0",
         prompt: str = PROMPT) -> None:
    k, v = (kv.split("/") + kv.split("/"))[:2]
    llm = Llama(model, n_ctx=int(n_ctx), n_threads=2, logits_all=True, verbose=False, flash_attn=kv != "f16",
                type_k=GGML_TYPES[k], type_v=GGML_TYPES[v])
    ctx = llm.n_ctx()
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
    ids = llm.tokenize(prompt.encode(), add_bos=add_bos, special=True)
    llm.reset()
    llm.eval(ids)
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    greedy, margins, shifts = [], [], []
    for step in range(int(n_gen)):
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top2 = np.argsort(-last, kind="stable")[:2]
        greedy.append(int(top2[0]))
        margins.append(float(last[top2[0]] - last[top2[1]]))
        if llm.n_tokens + 1 >= ctx:                       # llama-server's pre_decode
            keep = min(ctx - 4, (len(ids) if int(n_keep) < 0 else int(n_keep)) + (1 if add_bos else 0))
            n_left = llm.n_tokens - keep
            discard = max(0, min(n_left // 2, n_left - 1))
            llama_cpp.llama_memory_seq_rm(mem, 0, keep, keep + discard)
            llama_cpp.llama_memory_seq_add(mem, 0, keep + discard, llm.n_tokens, -discard)
            llm.input_ids[keep:llm.n_tokens - discard] = llm.input_ids[keep + discard:llm.n_tokens].copy()
            llm.n_tokens -= discard
            shifts.append({"step": step, "n_keep": keep, "n_discard": discard})
        llm.eval([greedy[-1]])
    json.dump({"model": model, "n_ctx": ctx, "n_threads": 2, "kv": kv, "n_keep": int(n_keep), "text": prompt,
               "ids": list(ids), "greedy_ids": greedy, "greedy_margins": margins, "shifts": shifts}, open(out, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:8])
