"""A GGUF's unigram vocabulary (`tokenizer.ggml.model` "t5") checked and built into native/unigram.py's
tokenizer, with llama.cpp's defaults for what the file leaves out (T5's: EOS 1, UNK 2, no BOS)."""

from __future__ import annotations

import numpy as np

from .unigram import Unigram
from .vocabulary import bad


def build_unigram(tok, gguf) -> Unigram:
    """`tok`: the GGUFTokenizer being built (its tokens and types); sets its `sep`."""
    meta, n = gguf.metadata, len(tok.tokens)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None:
        raise bad(gguf, "tokenizer.ggml.scores", "a unigram vocabulary needs a score per token")
    ids = {}
    for key, default in (("unknown", 2), ("seperator", None)):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        if tid is not None and (isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or not 0 <= tid < n):
            raise bad(gguf, f"tokenizer.ggml.{key}_token_id", f"{tid!r} is not a token id (the vocabulary has {n} tokens)")
        ids[key] = None if tid is None else int(tid)
    tok.sep = ids["seperator"]
    charsmap = meta.get("tokenizer.ggml.precompiled_charsmap")
    if charsmap is not None:
        if not (isinstance(charsmap, np.ndarray) and charsmap.dtype.kind in "iu" and charsmap.itemsize == 1):
            raise bad(gguf, "tokenizer.ggml.precompiled_charsmap", "must be an array of bytes")
        charsmap = charsmap.astype(np.uint8).tobytes()
    try:
        return Unigram(tok.tokens, tok.token_types, scores, ids["unknown"], charsmap,
                       bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
                       bool(meta.get("tokenizer.ggml.remove_extra_whitespaces", False)))
    except ValueError as e:
        raise bad(gguf, "tokenizer.ggml.precompiled_charsmap", str(e)) from None
