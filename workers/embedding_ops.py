"""The embed and rerank ops of an inference worker (mixed into InferenceWorker).

An encoder (native/encoder.py: BERT-family embedders and rerankers) pools as its file says and
runs all of a request's inputs in one forward; a chat model embeds by its file's pooling too
(`<arch>.pooling_type`: Qwen3-Embedding's last token) or, when the file names none, by the mean of
its final hidden states, one input at a time. `dimensions` shortens a vector to its first
components and normalises again (Matryoshka models, as Ollama and OpenAI do); `truncate` cuts an
input to the context instead of refusing it (Ollama's /api/embed).
"""

from __future__ import annotations

import numpy as np

from kiln.native.encoder import Encoder
from kiln.native.generate import embed as decoder_embed
from kiln.native.gguf_file import GGUFError
from kiln.native.rerank import CausalRanker

from .worker import OpError, op


def normalized(v: np.ndarray, p: int = 2) -> np.ndarray:
    """llama.cpp's common_embd_normalize: -1 none, 0 by the largest magnitude (to int16's range),
    2 euclidean, p > 2 the p-norm; the sum in double, the vector times float(1 / sum)."""
    if p == -1:
        return v
    x = v.astype(np.float64)
    if p == 0:
        total = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif p == 2:
        total = float(np.sqrt(((v * v).astype(np.float64)).sum()))     # float squares, a double sum
    else:
        total = float((np.abs(x) ** p).sum() ** (1.0 / p))
    return (v * np.float32(1.0 / total if total > 0 else 0.0)).astype(np.float32)


class EmbeddingOps:
    """Needs `self.model`, `self.n_ctx`, `self._bounded`, `self._adapter`, `self.scheduler`."""

    def _inputs(self, items: list, truncate: bool, what: str = "input") -> list[list[int]]:
        tok = self.model.tokenizer
        out = []
        for i, x in enumerate(items):
            if isinstance(x, str):
                ids = self._prefix_tokens(x) if truncate else \
                    self._bounded(tok.encode, x, special=False, what=f"{what}[{i}]")
            else:
                ids = x if isinstance(x, list) else []       # (the HTTP routes check; a bus client may not)
            if not ids or not all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in ids):
                raise OpError("bad_request", f"{what}[{i}] is empty or has token ids outside [0, {tok.vocab_size})")
            if len(ids) > self.n_ctx:
                if not truncate:
                    raise OpError("context_length_exceeded", f"{what}[{i}] has {len(ids)} tokens; the context holds "
                                                             f"{self.n_ctx}")
                sep = getattr(tok, "sep", None)         # an encoder's input keeps its closing [SEP]
                ids = ids[:self.n_ctx - 1] + [ids[-1]] if sep is not None and ids[-1] == sep else ids[:self.n_ctx]
            out.append(ids)
        return out

    def _prefix_tokens(self, text: str) -> list[int]:
        """The tokens of a text that will be cut to the context: only as much of it as yields
        more than the context's tokens (a growing prefix), not the whole body, is tokenized."""
        tok, chars = self.model.tokenizer, 32 * self.n_ctx
        while True:
            ids = tok.encode(text[:chars], special=False)
            if chars >= len(text):
                return ids
            if len(ids) > self.n_ctx + 16:           # the cut is far past what is kept
                # the prefix's specials end it (an encoder's [SEP]); the whole text's end the same way
                return ids if not tok.special.add_eos and getattr(tok, "sep", None) is None else \
                    ids[:self.n_ctx - 1] + [ids[-1]]
            chars *= 4

    def _pooling(self) -> str:
        if isinstance(self.model, Encoder):
            return self.model.config.pooling
        return self.model.config.pooling or "mean"

    @op("embed")
    def embed(self, req):
        """Embeddings of several inputs (texts or token ids), float32 bytes each, normalised
        unless `normalize` is false. One op for the whole batch; a chat model is taken between
        decode steps."""
        b = req.body
        self.served += 1
        name, n_embd = self.model.path.stem, self.model.config.n_embd
        pooling = self._pooling()
        if pooling == "rank":
            raise OpError("bad_request", f"{name} is a reranker (its pooling is rank): it scores query-document pairs "
                                         f"and gives no embeddings; use /v1/rerank")
        per_token = pooling == "none"
        if per_token and not isinstance(self.model, Encoder):
            raise OpError("bad_request", f"{name}'s file says pooling_type none; Kiln embeds with a chat model "
                                         f"by mean, last or cls pooling only")
        if per_token and not b.get("per_token"):
            raise OpError("bad_request", f"{name} pools nothing (pooling_type none): its embeddings are one per "
                                         f"token, which only llama-server's /embedding returns")
        dims = b.get("dimensions")
        if dims is not None and not 1 <= dims <= n_embd:
            raise OpError("bad_request", f"dimensions = {dims}: {name} gives {n_embd}-dimensional embeddings; "
                                         f"dimensions may shorten them (1..{n_embd}), not lengthen them")
        norm = b.get("embd_normalize", 2 if b.get("normalize", True) else -1)
        if norm not in (-1, 0) and norm < 2:
            raise OpError("bad_request", f"embd_normalize = {norm}: -1 (none), 0 (max absolute), 2 (euclidean) or a "
                                         f"p-norm above 2")
        prompts = self._inputs(b["inputs"], bool(b.get("truncate")))
        if isinstance(self.model, Encoder):
            if b.get("adapter"):
                raise OpError("bad_request", f"{name} is an encoder: LoRA adapters apply to chat models")
            vectors = self.model.pooled(prompts)       # (n, n_embd) each when it pools nothing
        else:
            adapter = self._adapter(b)
            vectors = []
            for ids in prompts:
                if req.cancelled():
                    raise OpError("cancelled", "the request was cancelled")
                with self.scheduler.model_lock:
                    vectors.append(decoder_embed(self.model, ids, adapter=adapter, normalize=False, pooling=pooling))
        out = []
        for v in vectors:
            v = v[..., :dims] if dims else v
            out.append((v if per_token else normalized(v, norm)).astype("<f4").tobytes())   # as llama-server
        reply = {"embeddings": out, "dim": dims or n_embd, "usage": {"prompt_tokens": sum(map(len, prompts))}}
        return reply | ({"rows": [len(p) for p in prompts]} if per_token else {})

    @op("rerank")
    def rerank(self, req):
        """A relevance score for each document against the query, in the documents' order: an
        encoder's rank head on llama-server's prompt ([CLS] query [SEP] document), all pairs in one
        forward; a causal reranker's (Qwen3-Reranker) P(yes) on its rerank template, one pair at a
        time between decode steps."""
        b = req.body
        self.served += 1
        if self._pooling() != "rank":
            raise OpError("bad_request", f"{self.model.path.stem} is not a reranker (its pooling is {self._pooling()}, not rank); "
                                         f"load a reranking model such as bge-reranker or Qwen3-Reranker")
        docs = b["documents"]
        bad = next((i for i, d in enumerate(docs) if not isinstance(d, str)), None)
        if not docs or len(docs) > 1024 or bad is not None:
            raise OpError("bad_request", f"documents[{bad}] is not a string" if bad is not None else
                          "documents must hold 1 to 1,024 strings")
        if not isinstance(self.model, Encoder):
            return self._rerank_causal(req, b)
        tok = self.model.tokenizer
        query = self._bounded(tok.encode, b["query"], special=False, add_bos=False, what="query")
        docs = [self._bounded(tok.encode, d, special=False, add_bos=False, what=f"documents[{i}]")
                for i, d in enumerate(b["documents"])]
        prompts = self._fitting([self.model.rank_prompt(query, d) for d in docs])
        scores = [float(s[0]) for s in self.model.pooled(prompts)]
        return {"scores": scores, "usage": {"prompt_tokens": sum(map(len, prompts))}}

    def _rerank_causal(self, req, b):
        try:
            if getattr(self, "_ranker", None) is None:
                self._ranker = CausalRanker(self.model)
        except GGUFError as e:
            raise OpError("bad_request", str(e)) from None
        prompts = self._fitting([self._bounded(self._ranker.prompt, b["query"], d, what=f"documents[{i}]")
                                 for i, d in enumerate(b["documents"])])
        scores = []
        for ids in prompts:
            if req.cancelled():
                raise OpError("cancelled", "the request was cancelled")
            with self.scheduler.model_lock:
                scores.append(self._ranker.score(ids))
        return {"scores": scores, "usage": {"prompt_tokens": sum(map(len, prompts))}}

    def _fitting(self, prompts: list[list[int]]) -> list[list[int]]:
        for i, p in enumerate(prompts):
            if len(p) > self.n_ctx:
                raise OpError("context_length_exceeded", f"the query and documents[{i}] take {len(p)} tokens; the "
                                                         f"context holds {self.n_ctx}")
        return prompts
