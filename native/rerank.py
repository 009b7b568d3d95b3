"""Reranking with a causal model — Qwen3-Reranker as llama.cpp's converter writes it
(conversion/qwen.py): pooling type rank, `cls.output.weight` holding the output head's rows of the
answer tokens ("yes", "no"), and a "rerank" chat template with {query} and {document}.

llama.cpp scores a pair (build_pooling, rank, causal): the final hidden state of the prompt's last
token (after the output norm) times cls.output, a softmax over the answers; the score is the first
("yes"). The prompt is llama-server's: the template filled in and tokenized with special tokens
parsed and none added (format_prompt_rerank) — so markup in a query or document is parsed as the
model's own, as there; it can change only that pair's score.
"""

from __future__ import annotations

import numpy as np

from . import ggml_round, kernels
from .gguf_file import GGUFError
from .kernels import matmul

F32 = np.float32


class CausalRanker:
    def __init__(self, model):
        g, c = model.gguf, model.config
        if "cls.output.weight" not in g.tensors:
            raise GGUFError(f"{model.path}: pooling type rank needs the answers' head (tensor cls.output.weight) and "
                            f"the file has none; it is not a reranker")
        shape = g.tensor("cls.output.weight").shape
        if len(shape) != 2 or shape[1] != c.n_embd or not 1 <= shape[0] <= 64:
            raise GGUFError(f"{model.path}: tensor 'cls.output.weight' has shape {list(shape)}, expected [answers, "
                            f"{c.n_embd}]; the file is corrupt")
        self.model = model
        self.head = kernels.load_weights(g, ["cls.output.weight"])["cls.output.weight"]
        self.bias = kernels.load_vector(g, "cls.output.bias") if "cls.output.bias" in g.tensors else None
        if self.bias is not None and self.bias.shape != (shape[0],):
            raise GGUFError(f"{model.path}: tensor 'cls.output.bias' has shape {list(self.bias.shape)}, expected "
                            f"[{shape[0]}]; the file is corrupt")
        template = g.metadata.get("tokenizer.chat_template.rerank")
        self.template = template if isinstance(template, str) else None

    def prompt(self, query: str, document: str) -> list[int]:
        """llama-server's rerank prompt: the template filled in (special tokens parsed, none
        added), or without one BOS, the query, EOS, the document, EOS as the vocabulary adds them."""
        tok = self.model.tokenizer
        if self.template is not None:
            return tok.encode(self.template.replace("{query}", query).replace("{document}", document),
                              special=True, add_bos=False)
        sp = tok.special
        eos = [sp.eos] if sp.add_eos and sp.eos is not None else []
        ids = [sp.bos] if sp.add_bos and sp.bos is not None else []
        return ids + tok.encode(query, special=False, add_bos=False) + eos + \
            tok.encode(document, special=False, add_bos=False) + eos

    def score(self, ids: list[int]) -> float:
        """P(first answer) for one prompt: the last hidden state through the head, ggml's softmax."""
        m = self.model
        h = m.hidden(ids, m.new_cache(len(ids)))[-1:]
        # one row: F32 weights by ggml_vec_dot_f32 (tinyBLAS takes two or more), others by the kernels
        logits = ggml_round.vec_dot_f32(self.head.dense, h[0]) if int(self.head.qtype) == 0 else matmul(h, self.head)[0]
        if self.bias is not None:
            logits = logits + self.bias
        return float(softmax_ggml(logits)[0])


def softmax_ggml(x: np.ndarray) -> np.ndarray:
    """ggml_soft_max_f32 on one short row (fewer than 8: the C library's expf, the sum in double)."""
    x = np.asarray(x, F32)
    e = ggml_round.libm_expf(x - x.max()) if len(x) < 8 else ggml_round.expf(x - x.max())
    total = sum(float(v) for v in e)
    return (e * F32(1.0 / total)).astype(F32)
