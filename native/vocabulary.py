"""What a GGUF vocabulary must hold before a tokenizer is built from it (native/tokenizer.py).

Every array the tokenizer indexes by token id has one entry per token, of the right kind; the
special tokens Kiln feeds or stops on are ids of the vocabulary; and whatever HF `tokenizers`
refuses becomes a `TokenizerError` — a GGUFError naming the key — not the library's bare
Exception.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .gguf_file import GGUFError

# a SentencePiece vocabulary's merges are found by splitting every piece at every point: work
# that grows with the square of a piece's length (real vocabularies need well under 1/50 of this)
SPM_SPLIT_BUDGET = 2**30
_USED_IDS = ("bos", "eos", "eot", "eom")        # special tokens Kiln feeds or stops on
_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix")


class TokenizerError(GGUFError):
    """The tokenizer could not be built from this model's metadata (the file's fault: a GGUFError)."""


def bad(gguf, key: str, problem: str) -> TokenizerError:
    return TokenizerError(f"{gguf.path}: metadata key {key!r}: {problem}; the file is corrupt (re-download "
                          f"it) or its tokenizer is not one Kiln can build")


def _integers(values) -> bool:
    """A list or array of integers (token types)."""
    if isinstance(values, np.ndarray):
        return values.dtype.kind in "iu"
    return isinstance(values, list) and all(isinstance(v, (int, np.integer)) for v in values)


def check_vocabulary(gguf, tokens) -> None:
    """`tokens` and the arrays and ids that go with them, before anything is built from them."""
    meta, n = gguf.metadata, len(tokens)
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise bad(gguf, "tokenizer.ggml.tokens", "must be an array of strings")
    types, scores = meta.get("tokenizer.ggml.token_type"), meta.get("tokenizer.ggml.scores")
    if types is not None and not (len(types) == n and _integers(types)):
        raise bad(gguf, "tokenizer.ggml.token_type", f"must be an array of {n} integers, one per token")
    if scores is not None and not (len(scores) == n and isinstance(scores, np.ndarray)
                                   and scores.dtype.kind in "iuf"):
        raise bad(gguf, "tokenizer.ggml.scores", f"must be an array of {n} numbers, one per token")
    merges = meta.get("tokenizer.ggml.merges", [])
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise bad(gguf, "tokenizer.ggml.merges", "must be an array of strings")
    for key in _FLAGS:
        if not isinstance(meta.get(key, False), (bool, int, np.integer)):
            raise bad(gguf, key, "must be true or false")
    for key, tid in meta.items():
        if not (key.startswith("tokenizer.ggml.") and key.endswith("_token_id")):
            continue
        used = key.removeprefix("tokenizer.ggml.").removesuffix("_token_id") in _USED_IDS
        if isinstance(tid, bool) or not isinstance(tid, (int, np.integer)) or (used and not 0 <= tid < n):
            raise bad(gguf, key, f"{tid!r} is not a token id (the vocabulary has {n} tokens)")


@contextmanager
def building(gguf, model_type: str):
    """HF tokenizers refuses a bad vocabulary with a bare Exception (a merge of an unknown
    token, …): the file's fault, so a TokenizerError naming the key."""
    try:
        yield
    except GGUFError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's errors have no narrower type
        key = "tokenizer.ggml.merges" if model_type == "gpt2" else "tokenizer.ggml.tokens"
        raise bad(gguf, key, f"the tokenizer cannot be built from it ({e})") from e


def vocabulary_difference(a, b) -> str | None:
    """How two loaded models' vocabularies differ ("49152 vs 288 tokens", "… same count, other
    tokens"), or None when they are the same: what a draft model or a distillation teacher needs."""
    if a.config.n_vocab != b.config.n_vocab:
        return f"{a.config.n_vocab} vs {b.config.n_vocab} tokens"
    if a.tokenizer.tokens != b.tokenizer.tokens:
        return f"{a.config.n_vocab} vs {b.config.n_vocab} tokens, same count, other tokens"
    return None
