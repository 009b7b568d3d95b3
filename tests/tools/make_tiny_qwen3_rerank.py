"""tests/data/tiny/tiny-qwen3-rerank.gguf and its llama.cpp reference: a Qwen3-Reranker as
llama.cpp's converter writes one (conversion/qwen.py) — tiny-qwen3 with pooling type rank, the
classifier labels ["yes", "no"], `cls.output.weight` made of the output head's rows of the two
answer tokens (here "y" and "n": the tiny vocabulary has no "yes"/"no"; in F32, scaled by 0.05 so
that the random model's scores are not all 1), and the "rerank" chat
template with {query} and {document}. The reference is llama-cpp-python's `embed` with rank pooling
on llama-server's rerank prompt (the template filled in, tokenized with special tokens parsed and
none added): a softmax over [yes, no], whose first value is the score.

    python tests/tools/make_tiny_qwen3_rerank.py
"""

import json
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"
TEMPLATE = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
            "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
            "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n<Query>: "
            "{query}\n<Document>: {document}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
PAIRS = [("what is the capital of france?", ["Paris is the capital of France.", "The cat sat on the mat.",
                                             "Bread is baked in a hot oven."]),
         ("how do you bake clay pottery", ["Kiln fire bakes clay pottery.", "a quick brown fox"])]


def write(out: Path) -> None:
    import sys
    sys.path.insert(0, str(HERE))
    from gguf_copy import copy_gguf
    src = GGUFReader(TINY / "tiny-qwen3.gguf")
    tokens = src.fields["tokenizer.ggml.tokens"].contents()
    yes, no = tokens.index("y"), tokens.index("n")
    head = next(t for t in src.tensors if t.name == "output.weight")
    rows = dequantize(np.asarray(head.data)[[yes, no]], head.tensor_type).reshape(2, -1)
    copy_gguf(TINY / "tiny-qwen3.gguf", out, meta={
        "general.name": "tiny-qwen3-rerank", "qwen3.pooling_type": 4, "qwen3.classifier.output_labels": ["yes", "no"],
        "tokenizer.chat_template.rerank": TEMPLATE},
        add={"cls.output.weight": (rows * 0.05).astype(np.float32)})   # scaled: scores not all ~1


def main() -> None:
    import llama_cpp
    out = TINY / "tiny-qwen3-rerank.gguf"
    write(out)
    llm = llama_cpp.Llama(str(out), n_ctx=512, n_batch=512, n_ubatch=512, embedding=True, pooling_type=4,
                          n_threads=2, verbose=False)
    ref = {"model": out.name, "llama_cpp_python": llama_cpp.__version__, "pairs": []}
    for query, docs in PAIRS:
        row = {"query": query, "documents": docs, "ids": [], "scores": []}
        for d in docs:
            prompt = TEMPLATE.replace("{query}", query).replace("{document}", d)
            ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
            plain = llm.tokenize
            llm.tokenize = lambda text, *a, _ids=ids, **k: list(_ids)      # embed() tokenizes its text
            try:
                row["scores"].append([float(x) for x in llm.embed(f"{len(row['ids'])}", normalize=False)[:2]])
            finally:
                llm.tokenize = plain
            row["ids"].append(ids)
        ref["pairs"].append(row)
    (TINY / "tiny-qwen3-rerank.json").write_text(json.dumps(ref, indent=1))


if __name__ == "__main__":
    main()
